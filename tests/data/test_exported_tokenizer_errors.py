"""The exported character tokenizer, loaded back from its folder, on a character it cannot encode (issue 32 item 10).

It crashed with the `tokenizers` library's bare Exception ("WordLevel error: Missing [UNK] token"), which the
loaders do not catch as a bad row: no file:line, and `skip_invalid` did not skip the row. Now every loader names the
file, line and character, and skips and counts the row with `skip_invalid`, as for the built-in `CharTokenizer`.
"""
import json

import pytest

from megalign.data import CharTokenizer
from megalign.data.preference import load_preferences
from megalign.data.prompts import DataError, load_prompts
from megalign.data.sft import load_sft
from megalign.data.tokenizer import TokenizerConfig, build_tokenizer

pytest.importorskip("transformers")  # the export and its loading need it


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The character tokenizer as `save` exports it, loaded back as a run given its folder would."""
    folder = tmp_path_factory.mktemp("char_export")
    CharTokenizer().save(str(folder))
    return build_tokenizer(TokenizerConfig(path=str(folder)))


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_encode_names_the_character_and_its_position(exported):
    assert exported.name.startswith("hf ")  # loaded back as an HF tokenizer, not the built-in one
    assert exported.encode("2+2=") == CharTokenizer().encode("2+2=")
    with pytest.raises(ValueError, match=r"cannot encode '×' at position 1"):
        exported.encode("3×4")


def test_chat_template_error_position_is_in_the_rendered_text(exported):
    # The template renders "<bos>user: aé\n"; the text encoded is that rendering, so 'é' sits at
    # position len("<bos>user: a") = 12 of it.
    with pytest.raises(ValueError, match=r"cannot encode 'é' at position 12"):
        exported.apply_chat_template([{"role": "user", "content": "aé"}])


@pytest.mark.parametrize("tokenizer", ["exported", "builtin"])
def test_prompt_loader_names_file_line_and_character_and_skip_invalid_counts_the_row(tokenizer, exported, tmp_path):
    tok = exported if tokenizer == "exported" else CharTokenizer()
    path = write_rows(tmp_path / "p.jsonl", [{"prompt": "1+1=", "answer": "2"}, {"prompt": "3×4=", "answer": "12"},
                                             {"prompt": "2+2=", "answer": "4"}])
    with pytest.raises(DataError, match=rf"^{path}:2: .*cannot encode '×' at position 1"):
        load_prompts(path, tok, 64)
    data = load_prompts(path, tok, 64, skip_invalid=True)
    assert (data.stats.rows, data.stats.invalid, data.stats.kept) == (3, 1, 2)
    assert [e.answer for e in data.examples] == ["2", "4"]


def test_sft_and_preference_loaders_skip_and_count_the_row(exported, tmp_path):
    sft = write_rows(tmp_path / "s.jsonl", [{"prompt": "1+1=", "response": "2"}, {"prompt": "1+1=", "response": "2²"}])
    with pytest.raises(DataError, match=rf"^{sft}:2: .*cannot encode '²' at position 1"):
        load_sft(sft, exported, 64)
    examples, stats = load_sft(sft, exported, 64, skip_invalid=True)
    assert (len(examples), stats.rows, stats.invalid, stats.kept) == (1, 2, 1, 1)

    pairs = write_rows(tmp_path / "d.jsonl", [{"prompt": "1+1=", "chosen": "2", "rejected": "3"},
                                              {"prompt": "1+1=", "chosen": "2", "rejected": "½"}])
    with pytest.raises(DataError, match=rf"^{pairs}:2: .*cannot encode '½' at position 0"):
        load_preferences(pairs, exported, 64)
    examples, stats = load_preferences(pairs, exported, 64, skip_invalid=True)
    assert (len(examples), stats.rows, stats.invalid, stats.kept) == (1, 2, 1, 1)
