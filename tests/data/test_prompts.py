"""Prompt datasets (JSONL, Parquet, datasets folders; bad rows; length filter) and the resumable, sharded sampler."""
import json
import logging

import pytest

from megalign.data import CharTokenizer, DataError, PromptSampler, load_prompts

TOK = CharTokenizer()
GOOD_ROWS = [
    {"prompt": "1+2=", "answer": 3, "id": "a"},
    {"messages": [{"role": "user", "content": "2*3="}], "answer": "6", "level": 1},
    {"prompt": "10-4=", "answer": 6.0},
]


def write_jsonl(path, lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def write_parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns = list(dict.fromkeys(k for row in rows for k in row))  # from_pylist would only see row 0's keys
    pq.write_table(pa.Table.from_pylist([{k: row.get(k) for k in columns} for row in rows]), str(path))
    return path


def write_hf_dataset(path, rows):
    """A folder written by `datasets.Dataset.save_to_disk` (skips the test without datasets)."""
    datasets = pytest.importorskip("datasets")
    columns = list(dict.fromkeys(k for row in rows for k in row))
    datasets.Dataset.from_list([{k: row.get(k) for k in columns} for row in rows]).save_to_disk(str(path))
    return path


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "datasets"])
def test_prompt_and_messages_rows_load_with_metadata(tmp_path, kind):
    path = tmp_path / f"p.{kind}"
    if kind == "jsonl":
        write_jsonl(path, GOOD_ROWS)
    else:  # a parquet / arrow column has one type: answers as strings
        (write_parquet if kind == "parquet" else write_hf_dataset)(path, [{**row, "answer": str(row["answer"])}
                                                                          for row in GOOD_ROWS])
    ds = load_prompts(path, TOK, max_prompt_length=64)
    assert len(ds) == 3
    first, second, third = ds[0], ds[1], ds[2]
    assert first.prompt_ids == [1] + TOK.encode("1+2=")
    assert first.prompt_text == "1+2="
    assert second.prompt_text == "user: 2*3=\nassistant: "  # messages go through the chat template
    assert [first.answer, second.answer, third.answer] == ([3, "6", 6.0] if kind == "jsonl" else ["3", "6", "6.0"])
    if kind == "jsonl":
        assert first.metadata == {"id": "a"} and second.metadata == {"level": 1}
        assert (first.source, third.source) == (f"{path}:1", f"{path}:3")
    else:  # parquet and datasets give every row every column, missing ones as None
        assert first.metadata == {"id": "a", "level": None}
        assert third.source == f"{path} row 2"
    assert ds.stats.as_dict() == {"data/rows": 3, "data/kept": 3, "data/invalid": 0, "data/too_long": 0}


def test_template_prompts_wraps_prompt_strings_as_a_user_message(tmp_path):
    ds = load_prompts(write_jsonl(tmp_path / "p.jsonl", GOOD_ROWS[:1]), TOK, 64, template_prompts=True)
    assert ds[0].prompt_text == "user: 1+2=\nassistant: "


BAD_LINES = [
    ('{"prompt": "1+1=", "answer": 2', "invalid JSON"),
    ('[1, 2]', "a row must be an object"),
    ('{"answer": 2}', "a row needs exactly one of 'prompt' or 'messages' \\(fields: answer\\)"),
    ('{"prompt": "x", "messages": [{"role": "user", "content": "x"}], "answer": 2}', "a row needs exactly one of .*fields: answer, messages, prompt"),
    ('{"prompt": "1+1="}', "'answer' must be a string or number, got None"),
    ('{"prompt": "1+1=", "answer": true}', "'answer' must be a string or number, got True"),
    ('{"prompt": 7, "answer": 2}', "'prompt' must be a non-empty string, got 7"),
    ('{"messages": [{"role": "user"}], "answer": 2}', r"messages\[0\]\.content must be a string"),
    ('{"prompt": "1\\u00e9", "answer": 2}', "CharTokenizer cannot encode 'é' at position 1"),
    ('{"prompt": "1+1=", "answer": NaN}', "'answer' must be finite, got nan"),
]


@pytest.mark.parametrize("line, message", BAD_LINES)
def test_malformed_jsonl_row_names_file_and_line(tmp_path, line, message):
    path = write_jsonl(tmp_path / "p.jsonl", [GOOD_ROWS[0], "", line])  # the blank line 2 is not a row
    with pytest.raises(DataError, match=f"p.jsonl:3: {message}"):
        load_prompts(path, TOK, 64)


def test_malformed_parquet_row_names_file_and_row(tmp_path):
    path = write_parquet(tmp_path / "p.parquet", [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": None}])
    with pytest.raises(DataError, match=r"p.parquet row 1: 'answer' must be a string or number"):
        load_prompts(path, TOK, 64)


def test_skip_invalid_and_too_long_are_counted_and_logged(tmp_path, caplog):
    lines = [GOOD_ROWS[0]] + [line for line, _ in BAD_LINES] + [{"prompt": "123456789+1=", "answer": 123456790}, GOOD_ROWS[2]]
    path = write_jsonl(tmp_path / "p.jsonl", lines)
    with caplog.at_level(logging.WARNING, logger="megalign.data.prompts"):
        ds = load_prompts(path, TOK, max_prompt_length=6, skip_invalid=True)  # "1+2=" is 5 ids with BOS, "10-4=" 6
    assert [ex.prompt_text for ex in ds] == ["1+2=", "10-4="]
    assert ds.stats.as_dict() == {"data/rows": 13, "data/kept": 2, "data/invalid": 10, "data/too_long": 1}
    assert "kept 2 of 13 rows; skipped 10 invalid and dropped 1 longer than 6 tokens" in caplog.text


def test_undecodable_line_and_unreadable_parquet_are_named(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"prompt": "1+1=", "answer": 2}\n{"prompt": "\xff", "answer": 2}\n')
    with pytest.raises(DataError, match="p.jsonl:2: not UTF-8"):
        load_prompts(path, TOK, 64)
    (tmp_path / "p.parquet").write_bytes(b"not parquet")
    with pytest.raises(DataError, match="p.parquet: cannot read as Parquet"):
        load_prompts(tmp_path / "p.parquet", TOK, 64)


def test_file_level_errors(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_prompts(tmp_path / "missing.jsonl", TOK, 64)
    (tmp_path / "p.csv").write_text("prompt,answer\n")
    with pytest.raises(DataError, match=r"p.csv: unknown prompt file type"):
        load_prompts(tmp_path / "p.csv", TOK, 64)
    with pytest.raises(DataError, match=r"no usable prompts"):
        load_prompts(write_jsonl(tmp_path / "p.jsonl", GOOD_ROWS), TOK, max_prompt_length=2)
    (tmp_path / "plain").mkdir()
    with pytest.raises(DataError, match=r"plain: a folder, but not one written by datasets' save_to_disk"):
        load_prompts(tmp_path / "plain", TOK, 64)


def test_dataset_dict_folder_is_refused_with_its_splits(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = datasets.Dataset.from_list([{"prompt": "1+1=", "answer": "2"}])
    datasets.DatasetDict({"train": rows, "test": rows}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataError, match=r"dd: a DatasetDict with splits \['train', 'test'\]; give the folder of one "
                                        r"split, e.g. .*dd/train"):
        load_prompts(tmp_path / "dd", TOK, 64)
    assert load_prompts(tmp_path / "dd" / "train", TOK, 64)[0].prompt_text == "1+1="


def test_unshuffled_sharding_matches_hand_worked_stream():
    # 5 prompts, 2 ranks, 2 per rank: global batches are stream positions 0-3, 4-7, ...;
    # rank 0 takes even positions, rank 1 odd ones; position 5 is prompt 0 of epoch 1.
    r0 = PromptSampler(5, shuffle=False, rank=0, world_size=2)
    r1 = PromptSampler(5, shuffle=False, rank=1, world_size=2)
    assert [r0.next_indices(2), r0.next_indices(2)] == [[0, 2], [4, 1]]
    assert [r1.next_indices(2), r1.next_indices(2)] == [[1, 3], [0, 2]]
    assert r0.epoch == 1 and r0.position == 8


@pytest.mark.parametrize("n, world, batch", [(10, 3, 2), (7, 2, 1), (12, 4, 3), (5, 1, 5)])
def test_sharded_shuffled_epochs_cover_every_prompt_exactly_once(n, world, batch):
    samplers = [PromptSampler(n, seed=3, rank=r, world_size=world) for r in range(world)]
    steps = 3 * n // (batch * world) + 1
    per_rank = [[i for _ in range(steps) for i in s.next_indices(batch)] for s in samplers]
    stream = [per_rank[k % world][k // world] for k in range(steps * batch * world)]  # undo the interleaving
    epochs = [stream[e * n:(e + 1) * n] for e in range(3)]
    assert all(sorted(epoch) == list(range(n)) for epoch in epochs)
    if n > 3:
        assert epochs[0] != epochs[1]  # each epoch is reshuffled


def test_sampler_is_deterministic_and_resumes_exactly():
    straight = PromptSampler(11, seed=7)
    expected = [straight.next_indices(4) for _ in range(6)]
    again = PromptSampler(11, seed=7)
    assert [again.next_indices(4) for _ in range(6)] == expected
    assert expected[0] != PromptSampler(11, seed=8).next_indices(4)
    first = PromptSampler(11, seed=7)
    head = [first.next_indices(4) for _ in range(3)]
    state = first.state_dict()
    assert state == {"position": 12, "num_prompts": 11, "seed": 7, "shuffle": True}
    resumed = PromptSampler(11, seed=7)
    resumed.load_state_dict(state)
    assert head + [resumed.next_indices(4) for _ in range(3)] == expected
    with pytest.raises(ValueError, match="sampler state has num_prompts=11 but this sampler has num_prompts=12"):
        PromptSampler(12, seed=7).load_state_dict(state)


def test_resume_on_another_world_size_continues_the_same_stream():
    one = PromptSampler(9, seed=1)
    one.next_indices(4)
    state = one.state_dict()
    tail = one.next_indices(6)  # positions 4..9
    halves = [PromptSampler(9, seed=1, rank=r, world_size=2) for r in range(2)]
    for s in halves:
        s.load_state_dict(state)
    got = [halves[r].next_indices(3) for r in range(2)]
    assert [got[k % 2][k // 2] for k in range(6)] == tail


def test_sampler_argument_checks():
    with pytest.raises(ValueError, match="rank must be in"):
        PromptSampler(3, rank=2, world_size=2)
    with pytest.raises(ValueError, match="num_prompts must be >= 1"):
        PromptSampler(0)
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        PromptSampler(3).next_indices(0)
