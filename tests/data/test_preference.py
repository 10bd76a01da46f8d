"""Offline alignment data: preference pairs, unpaired KTO examples and stepwise PRM examples.

Ids are worked by hand for `CharTokenizer` (printable character c has id ord(c) - 28: ids 0..2 are
<pad> <bos> <eos>, 3 is the newline, 4 the space), batches are checked against `collate_sft` of the
`encode_sft` pair, and bad rows must be named by file and line or row."""
import logging
import math

import pytest
import torch
from data.test_prompts import write_hf_dataset, write_jsonl, write_parquet
from data.test_sft_data import chatml_dir  # noqa: F401 (fixture)

from megalign.algos import prm_loss
from megalign.data import CharTokenizer, DataError, HFTokenizer
from megalign.data.preference import (
    PreferenceExample,
    UnpairedExample,
    collate_preferences,
    collate_unpaired,
    encode_prompt_and_replies,
    extract_prompt,
    fit_prompt,
    load_preferences,
    load_unpaired,
)
from megalign.data.sft import IGNORE_INDEX, collate_sft, encode_messages, encode_sft
from megalign.data.stepwise import StepwiseExample, collate_stepwise, encode_steps, load_stepwise

TOK = CharTokenizer()
BOS, EOS, NL = 1, 2, 3


def c(text):
    """Hand-worked CharTokenizer ids of printable text (no newline)."""
    return [ord(ch) - 28 for ch in text]


def user(content):
    return {"role": "user", "content": content}


def assistant(content):
    return {"role": "assistant", "content": content}


def test_string_pair_ids_and_batch_by_hand(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "1+2=", "chosen": "3", "rejected": "12", "margin": 0.5,
                                               "answer": 3}])
    (example,), stats = load_preferences(path, TOK, 64)
    assert example == PreferenceExample([BOS] + c("1+2="), c("3") + [EOS], c("12") + [EOS], 0.5, "1+2=", 3)
    batch = collate_preferences([example], TOK.pad_id)
    assert batch["input_ids"].tolist() == [[BOS] + c("1+2=3") + [0], [BOS] + c("1+2=12")]
    assert batch["attention_mask"].tolist() == [[1] * 6 + [0], [1] * 7]
    assert batch["targets"].tolist() == [[-100] * 4 + c("3") + [EOS, -100], [-100] * 4 + c("12") + [EOS]]
    assert batch["response_lengths"].tolist() == [2, 3]
    assert batch["margin"].tolist() == [0.5] and batch["margin"].dtype == torch.float32
    assert stats.as_dict() == {"data/rows": 1, "data/kept": 1, "data/invalid": 0, "data/too_long": 0,
                               "data/truncated": 0}


def test_pair_batch_is_collate_sft_of_the_sft_pairs():
    pairs = [("1+2=", "3", "4"), ("10*10=", "100", "1000"), ("7-9=", "-2", "2")]
    examples = [PreferenceExample(*_encode_pair(p, ch, rj)) for p, ch, rj in pairs]
    batch = collate_preferences(examples, TOK.pad_id)
    sft = collate_sft([encode_sft(p, ch, TOK) for p, ch, _ in pairs] + [encode_sft(p, rj, TOK) for p, _, rj in pairs],
                      TOK.pad_id)
    for key in ("input_ids", "attention_mask", "targets"):
        assert torch.equal(batch[key], sft[key]), key
    assert batch["input_ids"].shape == (6, len(c("10*10=1000")) + 1)  # + BOS + EOS - 1
    assert batch["response_lengths"].tolist() == (batch["targets"] != IGNORE_INDEX).sum(-1).tolist()


def _encode_pair(prompt, chosen, rejected, template_prompts=False):
    prompt_ids, replies = encode_prompt_and_replies(prompt, {"chosen": chosen, "rejected": rejected}, TOK,
                                                    template_prompts)
    return (prompt_ids, *replies)


def test_templated_string_prompt_is_the_sft_templated_pair():
    prompt_ids, chosen_ids, _ = _encode_pair("2*3=", "6", "5", template_prompts=True)
    assert prompt_ids + chosen_ids == encode_sft("2*3=", "6", TOK, template_prompts=True).ids
    assert prompt_ids == [BOS] + c("user: 2*3=") + [NL] + c("assistant: ")


def test_implicit_prompt_of_strings_follows_trl():
    assert extract_prompt("The sky is blue.", "The sky is green.") == ("The sky is", " blue.", " green.")
    assert extract_prompt("1+2=3", "1+2=4") == ("1+2=", "3", "4")
    assert extract_prompt("say yes", "say no") == ("say", " yes", " no")


def test_implicit_prompt_of_conversations_and_ids(tmp_path):
    chosen = [user("1+1="), assistant("2"), user("and 2+2?"), assistant("4")]
    rejected = chosen[:3] + [assistant("5")]
    assert extract_prompt(chosen, rejected) == (chosen[:3], [assistant("4")], [assistant("5")])
    (example,), _ = load_preferences(write_jsonl(tmp_path / "p.jsonl", [{"chosen": chosen, "rejected": rejected}]),
                                     TOK, 128)
    context = [BOS] + c("user: 1+1=") + [NL] + c("assistant: 2") + [EOS] + c("user: and 2+2?") + [NL]
    assert example.prompt_ids == context + c("assistant: ")
    assert (example.chosen_ids, example.rejected_ids) == (c("4") + [EOS], c("5") + [EOS])
    assert example.prompt_ids + example.chosen_ids == TOK.apply_chat_template(chosen, add_generation_prompt=False)
    assert example.prompt_text == "user: 1+1=\nassistant: 2user: and 2+2?\nassistant: "  # as load_prompts decodes


def test_explicit_conversation_matches_the_chat_template_and_encode_messages():
    prompt = [{"role": "system", "content": "be brief"}, user("9-1=")]
    prompt_ids, chosen_ids, rejected_ids = _encode_pair(prompt, [assistant("8")], [assistant("eight, I think")])
    assert prompt_ids + rejected_ids == TOK.apply_chat_template(prompt + [assistant("eight, I think")],
                                                                add_generation_prompt=False)
    sft = encode_messages(prompt + [assistant("8")], TOK)
    assert (prompt_ids, chosen_ids) == (sft.prompt_ids, sft.response_ids)


def test_chatml_reply_holds_content_and_end_of_turn(chatml_dir):  # noqa: F811
    tok = HFTokenizer(chatml_dir)
    prompt_ids, (reply,) = encode_prompt_and_replies([user("1+2=?")], {"chosen": [assistant("3")]}, tok)
    start, end, nl = 2, 3, tok.encode("\n")
    assert prompt_ids == [start] + tok.encode("user") + nl + tok.encode("1+2=?") + [end] + nl + [start] + \
        tok.encode("assistant") + nl
    assert reply == tok.encode("3") + [end] + nl  # the template closes the turn with <|im_end|> and a newline


def test_truncation_drops_or_cuts_the_prompt_from_the_left(tmp_path, caplog):
    rows = [{"prompt": "ab=", "chosen": "1", "rejected": "22"},            # 4 + 3 = 7 tokens: fits
            {"prompt": "abcdefgh=", "chosen": "1", "rejected": "22"},      # 10 + 3: over by 5
            {"prompt": "a", "chosen": "1234567", "rejected": "2"}]         # the reply alone (8) does not fit
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    kept, stats = load_preferences(path, TOK, max_length=8)
    assert [e.prompt_ids for e in kept] == [[BOS] + c("ab=")]
    assert (stats.too_long, stats.truncated, stats.kept) == (2, 0, 1)
    with caplog.at_level(logging.WARNING, logger="megalign.data.preference"):
        kept, stats = load_preferences(path, TOK, max_length=8, truncation="truncate_prompt")
    assert [e.prompt_ids for e in kept] == [[BOS] + c("ab="), [BOS] + c("fgh=")]  # BOS and the last 4 tokens
    assert kept[1].prompt_text == "fgh="
    assert stats.as_dict() == {"data/rows": 3, "data/kept": 2, "data/invalid": 0, "data/too_long": 1,
                               "data/truncated": 1}
    assert "kept 2 of 3 preference rows (1 with the prompt cut from the left); skipped 0 invalid and dropped 1 " \
           "longer than 8 tokens" in caplog.text
    assert fit_prompt([1, 5, 6, 7], 3, 4, "truncate_prompt") == [1]  # room for one prompt token: the first
    assert fit_prompt([1, 5, 6, 7], 4, 4, "truncate_prompt") is None
    with pytest.raises(ValueError, match="truncation must be one of drop, truncate_prompt"):
        load_preferences(path, TOK, 8, truncation="left")


STRING_ROWS = [
    {"prompt": "1+2=", "chosen": "3", "rejected": "4", "margin": 1.5, "answer": "3"},
    {"chosen": "The sky is blue.", "rejected": "The sky is green."},
    {"prompt": "q?", "chosen": "yes", "rejected": "no", "margin": 2},
]
CHAT_ROWS = [
    {"prompt": [user("hi")], "chosen": [assistant("hello")], "rejected": [assistant("go away")]},
    {"chosen": [user("2+2="), assistant("4")], "rejected": [user("2+2="), assistant("5")]},
]


def _rows_for(kind, rows, path):
    if kind == "jsonl":
        return write_jsonl(path, rows)
    return (write_parquet if kind == "parquet" else write_hf_dataset)(path, rows)


@pytest.mark.parametrize("kind", ["parquet", "datasets"])
@pytest.mark.parametrize("rows", [STRING_ROWS, CHAT_ROWS], ids=["strings", "chats"])
def test_parquet_and_datasets_folder_give_the_jsonl_pairs(tmp_path, kind, rows):
    expected, _ = load_preferences(write_jsonl(tmp_path / "p.jsonl", rows), TOK, 64)
    assert len(expected) == len(rows)
    examples, stats = load_preferences(_rows_for(kind, rows, tmp_path / f"p.{kind}"), TOK, 64)
    assert examples == expected and stats.kept == len(rows)
    if rows is STRING_ROWS:
        assert [e.margin for e in examples] == [1.5, 0.0, 2.0]


BAD_PAIR_ROWS = [
    ({"prompt": "q", "chosen": "a"}, r"a row needs 'chosen', 'rejected'; missing rejected \(fields: chosen, prompt\)"),
    ([1, 2], "a row must be an object with chosen, rejected, got list"),
    ({"prompt": "q", "chosen": 3, "rejected": "b"}, "'chosen' must be a non-empty string like 'prompt', got 3"),
    ({"prompt": "q", "chosen": "a", "rejected": ""}, "'rejected' must be a non-empty string like 'prompt', got ''"),
    ({"prompt": "", "chosen": "a", "rejected": "b"}, "'prompt' must be a non-empty string"),
    ({"prompt": 5, "chosen": "a", "rejected": "b"}, "'prompt' must be a string or a message list, got int"),
    ({"prompt": "q", "chosen": "a", "rejected": "a"}, "'chosen' and 'rejected' are identical: the pair carries no"),
    ({"chosen": "abc", "rejected": "xyz"}, r"'chosen' and 'rejected' share no prompt \(no common prefix\)"),
    ({"chosen": "ab", "rejected": "abc"}, "'chosen' is all prompt"),
    ({"chosen": "abc", "rejected": [assistant("x")]}, "'chosen' and 'rejected' must both be strings or both"),
    ({"chosen": [user("q"), assistant("a")], "rejected": [user("p"), assistant("a")]},
     "'chosen' and 'rejected' share no prompt"),
    ({"chosen": [user("q"), assistant("a"), user("r"), assistant("b")],
      "rejected": [user("q"), assistant("c"), user("r"), assistant("b")]},
     r"'chosen after the shared prompt': messages\[1\]\.role is 'user'; a reply must be assistant turns only"),
    ({"prompt": "q", "chosen": "a", "rejected": "b", "margin": "1"}, "'margin' must be a finite number, got '1'"),
    ({"prompt": "q", "chosen": "a", "rejected": "b", "margin": True}, "'margin' must be a finite number, got True"),
    ('{"prompt": "q", "chosen": "a", "rejected": "b", "margin": NaN}', "'margin' must be a finite number, got nan"),
    ({"prompt": [user("q")], "chosen": "a", "rejected": "b"}, "'chosen' must be a message list like 'prompt'"),
    ({"prompt": "q", "chosen": [assistant("a")], "rejected": "b"}, "'chosen' must be a non-empty string like"),
    ({"prompt": [user("q")], "chosen": [user("a")], "rejected": [assistant("b")]},
     r"'chosen': messages\[0\]\.role is 'user'; a reply must be assistant turns only"),
    ({"prompt": [user("q")], "chosen": [assistant("a")], "rejected": [assistant("")]},
     r"'rejected': messages\[0\]\.content must not be empty"),
    ({"prompt": [{"role": "robot", "content": "q"}], "chosen": [assistant("a")], "rejected": [assistant("b")]},
     r"'prompt': messages\[0\]\.role must be one of system, user, assistant, tool, got 'robot'"),
    ({"prompt": [{"role": "user"}], "chosen": [assistant("a")], "rejected": [assistant("b")]},
     r"'prompt': messages\[0\]\.content must be a string, got None"),
    ({"prompt": "q", "chosen": "\u00e9", "rejected": "b"}, "CharTokenizer cannot encode '\u00e9' at position 0"),
    ("{not json", "invalid JSON"),
]


@pytest.mark.parametrize("row, message", BAD_PAIR_ROWS)
def test_bad_pair_row_names_file_and_line(tmp_path, row, message):
    path = write_jsonl(tmp_path / "p.jsonl", [STRING_ROWS[0], "", row])  # the blank line 2 is not a row
    with pytest.raises(DataError, match=f"p.jsonl:3: {message}"):
        load_preferences(path, TOK, 64)


def test_invalid_pair_rows_are_skipped_and_counted(tmp_path):
    rows = STRING_ROWS + [row for row, _ in BAD_PAIR_ROWS]
    examples, stats = load_preferences(write_jsonl(tmp_path / "p.jsonl", rows), TOK, 64, skip_invalid=True)
    assert len(examples) == 3
    assert (stats.rows, stats.invalid) == (3 + len(BAD_PAIR_ROWS), len(BAD_PAIR_ROWS))
    with pytest.raises(DataError, match="p.jsonl: no usable preference rows"):
        load_preferences(write_jsonl(tmp_path / "p.jsonl", rows[3:]), TOK, 64, skip_invalid=True)
    with pytest.raises(ValueError, match="max_length must be >= 2"):
        load_preferences(tmp_path / "p.jsonl", TOK, 1)


@pytest.mark.parametrize("kind", ["parquet", "datasets"])
def test_bad_rows_name_file_and_row(tmp_path, kind):
    rows = [STRING_ROWS[0], {**STRING_ROWS[0], "rejected": "3"}]
    with pytest.raises(DataError, match=f"p.{kind} row 1: 'chosen' and 'rejected' are identical"):
        load_preferences(_rows_for(kind, rows, tmp_path / f"p.{kind}"), TOK, 64)
    rows = [{"prompt": "q", "completion": "a", "label": True}, {"prompt": "q", "completion": "", "label": False}]
    with pytest.raises(DataError, match=f"u.{kind} row 1: 'completion' must be a non-empty string"):
        load_unpaired(_rows_for(kind, rows, tmp_path / f"u.{kind}"), TOK, 64)


UNPAIRED_ROWS = [
    {"prompt": "1+2=", "completion": "3", "label": True},
    {"prompt": "5*5=", "completion": "10", "label": False, "answer": 25},
    {"prompt": [user("hi")], "completion": [assistant("hello")], "label": True},
]


def test_unpaired_ids_by_hand_and_from_parquet(tmp_path):
    examples, stats = load_unpaired(write_jsonl(tmp_path / "u.jsonl", UNPAIRED_ROWS), TOK, 64)
    assert examples[:2] == [UnpairedExample([BOS] + c("1+2="), c("3") + [EOS], True, "1+2="),
                            UnpairedExample([BOS] + c("5*5="), c("10") + [EOS], False, "5*5=", 25)]
    assert examples[2].prompt_ids + examples[2].completion_ids == TOK.apply_chat_template(
        [user("hi"), assistant("hello")], add_generation_prompt=False)
    assert stats.kept == 3
    string_rows = UNPAIRED_ROWS[:2]  # a Parquet column holds strings or lists, not both
    parquet, _ = load_unpaired(write_parquet(tmp_path / "u.parquet", string_rows), TOK, 64)
    assert parquet == examples[:2]


@pytest.mark.parametrize("row, message", [
    ({"prompt": "q", "completion": "a", "label": "yes"}, r"'label' must be a boolean \(true = desirable\), got 'yes'"),
    ({"prompt": "q", "completion": "a", "label": 1}, "'label' must be a boolean"),
    ({"prompt": "q", "label": True}, r"a row needs 'prompt', 'completion', 'label'; missing completion"),
    ({"prompt": [user("q")], "completion": [user("a")], "label": True}, r"'completion': messages\[0\]\.role is 'user'"),
])
def test_bad_unpaired_row_names_file_and_line(tmp_path, row, message):
    with pytest.raises(DataError, match=f"u.jsonl:2: {message}"):
        load_unpaired(write_jsonl(tmp_path / "u.jsonl", [UNPAIRED_ROWS[0], row]), TOK, 64)


def test_unpaired_truncation_counts(tmp_path):
    rows = [{"prompt": "abcdef=", "completion": "1", "label": True},
            {"prompt": "a", "completion": "12345", "label": False}]
    examples, stats = load_unpaired(write_jsonl(tmp_path / "u.jsonl", rows), TOK, 5, truncation="truncate_prompt")
    assert [e.prompt_ids for e in examples] == [[BOS] + c("f=")]  # 5 - 2 completion tokens
    assert (stats.truncated, stats.too_long) == (1, 1)


def test_kto_batch_mismatches_completions_as_trl_does():
    examples = [UnpairedExample([BOS] + c(p), c(a) + [EOS], label) for p, a, label in
                [("1+1=", "2", True), ("2+3=", "15", False), ("10-1=", "9", True)]]
    batch = collate_unpaired(examples, TOK.pad_id)
    t = batch["input_ids"].shape[1]
    assert batch["kl_input_ids"].shape == (3, t) and t == len(c("10-1=15")) + 1  # the longest is a mismatched row
    # TRL's rotation [c[-1]] + c[:-1]: prompt i with completion i - 1
    for i, j in enumerate([2, 0, 1]):
        ids = examples[i].prompt_ids + examples[j].completion_ids
        row = batch["kl_input_ids"][i].tolist()
        assert row[:len(ids) - 1] == ids[:-1] and set(row[len(ids) - 1:]) <= {TOK.pad_id}
        assert batch["kl_targets"][i].tolist()[:len(ids) - 1] == [-100] * (len(examples[i].prompt_ids) - 1) + \
            examples[j].completion_ids
        assert batch["kl_response_lengths"][i] == len(examples[j].completion_ids)
    matched = collate_sft([encode_sft(p, a, TOK) for p, a in [("1+1=", "2"), ("2+3=", "15"), ("10-1=", "9")]], 0)
    width = matched["input_ids"].shape[1]
    assert width == t - 1  # the matched half is padded one further, to the mismatched half's width
    for key, pad in (("input_ids", TOK.pad_id), ("attention_mask", 0), ("targets", IGNORE_INDEX)):
        assert torch.equal(batch[key][:, :width], matched[key])
        assert set(batch[key][:, width:].flatten().tolist()) == {pad}
    assert batch["labels"].tolist() == [True, False, True] and batch["labels"].dtype == torch.bool
    shifted = collate_unpaired(examples, TOK.pad_id, kl_shift=2)  # prompt i with completion i - 2 = i + 1 mod 3
    assert batch["kl_response_lengths"].tolist() == [2, 2, 3] and shifted["kl_response_lengths"].tolist() == [3, 2, 2]
    with pytest.raises(ValueError, match="at least 2 examples"):
        collate_unpaired(examples[:1], TOK.pad_id)
    with pytest.raises(ValueError, match="kl_shift=3 is a multiple of the batch size 3"):
        collate_unpaired(examples, TOK.pad_id, kl_shift=3)

class StrippingTokenizer(CharTokenizer):
    """Drops surrounding spaces and has no BOS, as some HF tokenizers do: a blank prompt encodes to nothing."""

    def encode(self, text, add_bos=False):
        return super().encode(text.strip())


def test_a_prompt_of_no_tokens_is_a_row_error(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "  ", "chosen": "a", "rejected": "b"}])
    with pytest.raises(DataError, match="p.jsonl:1: 'prompt' encodes to no token"):
        load_preferences(path, StrippingTokenizer(), 64)
    path = write_jsonl(tmp_path / "s.jsonl", [{"prompt": "  ", "completions": ["a1"], "labels": [True]}])
    with pytest.raises(DataError, match="s.jsonl:1: 'prompt' encodes to no token"):
        load_stepwise(path, StrippingTokenizer(), 64)


def test_example_invariants():
    with pytest.raises(ValueError, match="chosen and rejected are the same tokens"):
        PreferenceExample([1], [5, 2], [5, 2])
    with pytest.raises(ValueError, match="margin must be finite"):
        PreferenceExample([1], [5, 2], [6, 2], margin=math.inf)
    with pytest.raises(ValueError, match="label must be a bool"):
        UnpairedExample([1], [5, 2], 1)
    with pytest.raises(ValueError, match="at least one example"):
        collate_preferences([], 0)


def test_stepwise_positions_labels_and_batch_by_hand():
    prompt_ids = [BOS] + c("1+2*3=")
    example = encode_steps(prompt_ids, ["2*3=6", "1+6=7"], [True, 0.25], TOK)
    assert example.ids == prompt_ids + c("2*3=6") + [NL] + c("1+6=7") + [NL]
    assert example.step_positions == [12, 18] and example.labels == [1.0, 0.25]  # the separators themselves
    short = encode_steps([BOS] + c("4="), ["\\boxed{4}"], [False], TOK)
    batch = collate_stepwise([example, short], TOK.pad_id)
    assert batch["input_ids"][1].tolist() == [BOS] + c("4=\\boxed{4}") + [NL] + [0] * 6
    assert batch["attention_mask"].sum(-1).tolist() == [19, 13]
    labels = batch["step_labels"]
    assert labels.dtype == torch.float32 and labels.shape == (2, 19)
    assert {(i, j): labels[i, j].item() for i, j in (labels != IGNORE_INDEX).nonzero().tolist()} == \
        {(0, 12): 1.0, (0, 18): 0.25, (1, 12): 0.0}
    loss, stats = prm_loss(torch.zeros(2, 19, 2), labels)  # the layout prm_loss expects: one step per label
    assert stats.num_steps.item() == 3 and loss.item() == pytest.approx(3 * math.log(2))
    two = encode_steps(prompt_ids, ["2*3=6"], [True], TOK, separator="\n\n")
    assert two.ids[-2:] == [NL, NL] and two.step_positions == [len(two.ids) - 1]  # the separator's last token


STEP_ROWS = [
    {"prompt": "1+2*3=", "completions": ["2*3=6", "1+6=7"], "labels": [True, True]},
    {"prompt": "2*2=", "completions": ["2*2=5", "\\boxed{5}"], "labels": [False, False], "answer": 4},
]


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "datasets"])
def test_stepwise_rows_load_alike_from_every_format(tmp_path, kind):
    examples, stats = load_stepwise(_rows_for(kind, STEP_ROWS, tmp_path / f"s.{kind}"), TOK, 64)
    assert examples == [encode_steps([BOS] + c(r["prompt"]), r["completions"], r["labels"], TOK) for r in STEP_ROWS]
    assert stats.kept == 2


def test_stepwise_soft_labels_truncation_and_template(tmp_path):
    rows = [{"prompt": "abcdef=", "completions": ["1", "2"], "labels": [0.5, 0]}]
    path = write_jsonl(tmp_path / "s.jsonl", rows)
    (example,), stats = load_stepwise(path, TOK, 7, truncation="truncate_prompt")
    assert example == StepwiseExample([BOS] + c("f=1") + [NL] + c("2") + [NL], [4, 6], [0.5, 0.0])
    assert stats.truncated == 1
    with pytest.raises(DataError, match="no usable stepwise rows"):
        load_stepwise(path, TOK, 7)
    (templated,), _ = load_stepwise(path, TOK, 64, template_prompts=True)
    assert templated.ids[:templated.step_positions[0] - 1] == TOK.apply_chat_template([user("abcdef=")])


@pytest.mark.parametrize("row, message", [
    ({"prompt": "q", "completions": ["a", "b"], "labels": [True]},
     r"'labels' must be a list of one label per step \(2 steps\)"),
    ({"prompt": "q", "completions": [], "labels": []}, "'completions' must be a non-empty list of step strings"),
    ({"prompt": "q", "completions": ["a", "b"], "labels": [True, 1.5]},
     r"labels\[1\] must be a boolean or a number in \[0, 1\], got 1.5"),
    ({"prompt": "q", "completions": ["a", "b"], "labels": [True, "yes"]}, r"labels\[1\] must be a boolean"),
    ({"prompt": "q", "completions": ["a\nb"], "labels": [True]}, r"completions\[0\] contains the step separator"),
    ({"prompt": "q", "completions": ["a", ""], "labels": [True, True]}, r"completions\[1\] must be a non-empty string"),
    ({"prompt": [user("q")], "completions": ["a"], "labels": [True]}, "'prompt' must be a non-empty string"),
    ({"completions": ["a"], "labels": [True]}, "a row needs 'prompt', 'completions', 'labels'; missing prompt"),
])
def test_bad_stepwise_row_names_file_and_line(tmp_path, row, message):
    with pytest.raises(DataError, match=f"s.jsonl:2: {message}"):
        load_stepwise(write_jsonl(tmp_path / "s.jsonl", [STEP_ROWS[0], row]), TOK, 64)

def test_stepwise_example_invariants():
    with pytest.raises(ValueError, match="step_positions must increase"):
        StepwiseExample([1, 5, 3, 6, 3], [4, 2], [1.0, 0.0])
    with pytest.raises(ValueError, match=r"must lie in \[1, 3\)"):
        StepwiseExample([1, 5, 3], [3], [1.0])
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 1\]"):
        StepwiseExample([1, 5, 3], [2], [2.0])
    with pytest.raises(ValueError, match="at least one example"):
        collate_stepwise([], 0)
