"""SFT data: hand-worked loss masks for chats (char and an HF template built offline), bad rows named by
file and row, the length filter, and the same examples from JSONL, Parquet and a datasets folder."""
import logging

import pytest
import torch
from data.hf_tok_fixtures import save_char_level_hf_tokenizer
from data.test_prompts import write_hf_dataset, write_jsonl, write_parquet

from megalign.data import CharTokenizer, DataError, HFTokenizer
from megalign.data.sft import IGNORE_INDEX, SFTExample, collate_sft, encode_messages, encode_sft, load_sft

TOK = CharTokenizer()
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+2="},
        {"role": "assistant", "content": "3"}, {"role": "user", "content": "times 4?"},
        {"role": "assistant", "content": "12"}]


def test_char_chat_masks_the_assistant_turns_and_their_eos():
    example = encode_messages(CHAT, TOK)
    # hand-worked: <bos> "system: be brief\nuser: 1+2=\nassistant: " ["3" <eos>] "user: times 4?\nassistant: " ["12" <eos>]
    first = [1] + TOK.encode("system: be brief\nuser: 1+2=\nassistant: ")
    second = TOK.encode("user: times 4?\nassistant: ")
    assert example.ids == first + [TOK.encode("3")[0], 2] + second + TOK.encode("12") + [2]
    assert example.loss_mask == [False] * len(first) + [True] * 2 + [False] * len(second) + [True] * 3
    assert example.ids == TOK.apply_chat_template(CHAT, add_generation_prompt=False)
    assert example.prompt_ids == first
    targets = collate_sft([example], TOK.pad_id)["targets"][0].tolist()
    assert TOK.decode([t for t in targets if t != IGNORE_INDEX], skip_special=False) == "3<eos>12<eos>"


def test_one_turn_chat_is_the_templated_pair():
    chat = encode_messages([{"role": "user", "content": "2*3="}, {"role": "assistant", "content": "<answer>6</answer>"}], TOK)
    assert chat == encode_sft("2*3=", "<answer>6</answer>", TOK, template_prompts=True)


def test_collate_pads_and_ignores_untrained_positions():
    a = SFTExample([1, 10, 11, 12, 2], [False, False, True, False, True])
    b = SFTExample([1, 20, 2], [False, True, True])
    batch = collate_sft([a, b], pad_id=0)
    assert batch["input_ids"].tolist() == [[1, 10, 11, 12], [1, 20, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert batch["targets"].tolist() == [[-100, 11, -100, 2], [20, 2, -100, -100]]
    assert batch["targets"].dtype == torch.long


def test_example_invariants():
    with pytest.raises(ValueError, match="2 ids but 3 loss_mask"):
        SFTExample([1, 2], [False, True, True])
    with pytest.raises(ValueError, match="no token carries loss"):
        SFTExample([1, 2], [False, False])
    with pytest.raises(ValueError, match="the first token cannot carry loss"):
        SFTExample([1, 2], [True, True])


@pytest.fixture(scope="module")
def chatml_dir(tmp_path_factory):
    """A one-token-per-character HF tokenizer with ChatML special tokens and template, saved locally."""
    pytest.importorskip("transformers")
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return save_char_level_hf_tokenizer(tmp_path_factory.mktemp("chatml"),
                                        ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                        "abcdefghijklmnopqrstuvwxyz0123456789+-*=?<>/ \n", template,
                                        eos_token="<|im_end|>", pad_token="<|endoftext|>")


def test_chatml_masks_content_and_end_of_turn(chatml_dir):
    from transformers import AutoTokenizer

    tok = HFTokenizer(chatml_dir)
    messages = [{"role": "user", "content": "1+2=?"}, {"role": "assistant", "content": "3"},
                {"role": "user", "content": "and 2*2"}, {"role": "assistant", "content": "4"}]
    example = encode_messages(messages, tok)
    reference = AutoTokenizer.from_pretrained(chatml_dir).apply_chat_template(messages, add_generation_prompt=False)
    reference = reference["input_ids"] if hasattr(reference, "keys") else reference  # v5 returns a BatchEncoding
    assert example.ids == list(reference)
    # hand-worked: each assistant turn trains on its content, <|im_end|> and the newline after it
    s, e, nl = 2, 3, tok.encode("\n")
    turn = lambda role, content: [s] + tok.encode(role) + nl + tok.encode(content) + [e] + nl  # noqa: E731
    assert example.ids == turn("user", "1+2=?") + turn("assistant", "3") + turn("user", "and 2*2") + turn("assistant", "4")
    header = [s] + tok.encode("assistant") + nl
    user1, user2 = turn("user", "1+2=?"), turn("user", "and 2*2")
    assert example.loss_mask == ([False] * (len(user1) + len(header)) + [True] * 3
                                 + [False] * (len(user2) + len(header)) + [True] * 3)


def test_template_that_rewrites_earlier_turns_is_an_error(chatml_dir, tmp_path):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(chatml_dir)  # like templates that drop past reasoning: older answers vanish
    hf.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                        "{% if m['role'] != 'assistant' or loop.last %}{{ m['content'] }}{% endif %}<|im_end|>\n"
                        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    hf.save_pretrained(str(tmp_path))
    rows = [{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                          {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]}]
    with pytest.raises(DataError, match=r"s.jsonl:1: the chat template does not render messages\[:2\] as a prefix"):
        load_sft(write_jsonl(tmp_path / "s.jsonl", rows), HFTokenizer(str(tmp_path)), 256)


GOOD_ROWS = [
    {"prompt": "1+2=", "response": "<answer>3</answer>", "answer": "3"},
    {"messages": CHAT},
    {"messages": [{"role": "user", "content": "9-1="}, {"role": "assistant", "content": "8"}]},
]


def _rows_for(kind, rows, path):
    if kind == "jsonl":
        return write_jsonl(path, rows)
    return (write_parquet if kind == "parquet" else write_hf_dataset)(path, rows)


@pytest.mark.parametrize("kind", ["parquet", "datasets"])
def test_parquet_and_datasets_folder_give_the_jsonl_examples(tmp_path, kind):
    expected, stats = load_sft(write_jsonl(tmp_path / "s.jsonl", GOOD_ROWS), TOK, 256)
    assert stats.as_dict() == {"data/rows": 3, "data/kept": 3, "data/invalid": 0, "data/too_long": 0}
    assert expected[0] == encode_sft("1+2=", "<answer>3</answer>", TOK) and expected[1] == encode_messages(CHAT, TOK)
    examples, _ = load_sft(_rows_for(kind, GOOD_ROWS, tmp_path / f"s.{kind}"), TOK, 256)
    assert examples == expected


BAD_ROWS = [
    ({"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]}, r"messages\[0\]\.content must be a string"),
    ({"messages": [{"role": "robot", "content": "hi"}, {"role": "assistant", "content": "x"}]},
     r"messages\[0\]\.role must be one of system, user, assistant, tool, got 'robot'"),
    ({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]},
     "messages have no assistant turn to train on"),
    ({"messages": [{"role": "assistant", "content": "x"}]}, r"messages\[0\] is an assistant turn: it has no context"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]},
     r"messages\[1\]\.content must not be empty"),
    ({"messages": []}, "messages must be a non-empty list"),
    ({"prompt": "q", "response": "r", "messages": CHAT}, "a row needs either 'prompt' and 'response', or 'messages' "
                                                        r"\(fields: messages, prompt, response\)"),
    ({"answer": "3"}, r"a row needs either .*\(fields: answer\)"),
    ({"prompt": "q"}, "'response' must be a non-empty string, got None"),
]


@pytest.mark.parametrize("row, message", BAD_ROWS)
def test_bad_jsonl_row_names_file_and_line(tmp_path, row, message):
    path = write_jsonl(tmp_path / "s.jsonl", [GOOD_ROWS[0], "", row])  # the blank line 2 is not a row
    with pytest.raises(DataError, match=f"s.jsonl:3: {message}"):
        load_sft(path, TOK, 256)


@pytest.mark.parametrize("kind", ["parquet", "datasets"])
def test_bad_row_names_file_and_row(tmp_path, kind):
    rows = [GOOD_ROWS[1], {"messages": [{"role": "user", "content": "q"}, {"role": "model", "content": "a"}]}]
    with pytest.raises(DataError, match=fr"s.{kind} row 1: messages\[1\]\.role must be one of"):
        load_sft(_rows_for(kind, rows, tmp_path / f"s.{kind}"), TOK, 256)


def test_invalid_and_too_long_rows_are_counted(tmp_path, caplog):
    rows = GOOD_ROWS + [row for row, _ in BAD_ROWS] + ["not json"]
    long_enough = len(encode_messages(CHAT, TOK)) - 1  # CHAT is the longest: dropped, the others kept
    with caplog.at_level(logging.WARNING, logger="megalign.data.sft"):
        examples, stats = load_sft(write_jsonl(tmp_path / "s.jsonl", rows), TOK, long_enough, skip_invalid=True)
    assert examples == [encode_sft("1+2=", "<answer>3</answer>", TOK), encode_messages(GOOD_ROWS[2]["messages"], TOK)]
    assert stats.as_dict() == {"data/rows": 13, "data/kept": 2, "data/invalid": 10, "data/too_long": 1}
    assert f"kept 2 of 13 rows; skipped 10 invalid and dropped 1 longer than {long_enough} tokens" in caplog.text


def test_file_level_errors(tmp_path):
    with pytest.raises(DataError, match="missing.jsonl: SFT file does not exist"):
        load_sft(tmp_path / "missing.jsonl", TOK, 64)
    (tmp_path / "s.csv").write_text("prompt,response\n")
    with pytest.raises(DataError, match="s.csv: unknown SFT file type"):
        load_sft(tmp_path / "s.csv", TOK, 64)
    with pytest.raises(DataError, match="no usable SFT rows"):
        load_sft(write_jsonl(tmp_path / "s.jsonl", GOOD_ROWS), TOK, max_length=4)
    with pytest.raises(ValueError, match="max_length must be >= 2"):
        load_sft(tmp_path / "s.jsonl", TOK, max_length=1)
