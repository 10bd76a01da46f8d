"""The character tokenizer (hand-worked ids), the HF wrapper on a tokenizer built offline, the
tokenizer-choice rule and the vocabulary check."""
import shutil

import pytest
from data.hf_tok_fixtures import save_char_level_hf_tokenizer

from megalign.config import load_config
from megalign.data import CharTokenizer, HFTokenizer, TokenizerConfig, build_tokenizer, check_vocab


def test_char_tokenizer_ids_and_round_trip():
    tok = CharTokenizer()
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.vocab_size) == (0, 1, 2, 99)
    # ids: 3 is newline, then printable ASCII from ' ' (32) at 4, so id = ord(c) - 28
    assert tok.encode("1+2=", add_bos=True) == [1, ord("1") - 28, ord("+") - 28, ord("2") - 28, ord("=") - 28]
    assert tok.encode("a\n~") == [69, 3, 98]
    text = "<think>12*3 = 36</think>\n<answer>-36</answer> {}|~"
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode([1, 69, 2, 0]) == "a"
    assert tok.decode([1, 69, 2, 0], skip_special=False) == "<bos>a<eos><pad>"


def test_char_tokenizer_rejects_what_it_cannot_represent():
    tok = CharTokenizer()
    with pytest.raises(ValueError, match=r"cannot encode 'é' at position 2"):
        tok.encode("caé")
    with pytest.raises(ValueError, match="cannot decode id 99"):
        tok.decode([99])


def test_char_chat_template_is_the_documented_plain_text():
    tok = CharTokenizer()
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2="}]
    assert tok.decode(tok.apply_chat_template(messages), skip_special=False) == "<bos>system: be brief\nuser: 2+2=\nassistant: "
    assert tok.decode(tok.apply_chat_template(messages, add_generation_prompt=False)) == "system: be brief\nuser: 2+2=\n"
    with pytest.raises(ValueError, match=r"messages\[1\]\.content must be a string"):
        tok.apply_chat_template([{"role": "user", "content": "x"}, {"role": "user", "content": 3}])
    with pytest.raises(ValueError, match="non-empty list"):
        tok.apply_chat_template([])
    with pytest.raises(ValueError, match=r"messages\[0\]: CharTokenizer cannot encode 'é' at position 7"):
        tok.apply_chat_template([{"role": "user", "content": "1é"}])


def test_char_chat_template_ends_assistant_turns_with_eos():
    tok = CharTokenizer()
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}, {"role": "user", "content": "r"}]
    # <bos> "user: q\n" "assistant: a" <eos> "user: r\n" "assistant: "
    expected = [1] + tok.encode("user: q\nassistant: a") + [2] + tok.encode("user: r\nassistant: ")
    assert tok.apply_chat_template(messages) == expected


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny word-level (one token per character) HF tokenizer with a chat template, saved locally."""
    pytest.importorskip("transformers")  # an optional dependency: only HFTokenizer needs it
    template = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    return save_char_level_hf_tokenizer(tmp_path_factory.mktemp("hf_tok"), ["<pad>", "<s>", "</s>", "<unk>"],
                                        "abcdefghijklmnopqrstuvwxyz0123456789+-*=<>|/ \n", template,
                                        bos_token="<s>", eos_token="</s>")


def test_hf_wrapper_ids_template_and_pad_fallback(hf_dir):
    tok = build_tokenizer(load_config(TokenizerConfig, overrides=["kind=hf", f"path={hf_dir}"]))
    assert isinstance(tok, HFTokenizer)
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (1, 2, 2, 50)  # 4 specials + 46 chars; no pad: eos
    assert tok.encode("ab1", add_bos=True) == [1, 4, 5, 31]  # a=4, b=5, digits from 30
    assert tok.decode(tok.encode("12+3=")) == "12+3="
    ids = tok.apply_chat_template([{"role": "user", "content": "1+1="}])
    expected = [1] + tok.encode("<|user|>1+1=\n<|assistant|>")  # the template writes BOS itself, once
    assert ids == expected


def test_tokenizer_config_checks_path():
    with pytest.raises(ValueError, match="tokenizer.path is required for kind 'hf'"):
        TokenizerConfig(kind="hf")
    with pytest.raises(ValueError, match="unused for kind 'char'"):
        TokenizerConfig(kind="char", path="/x")


def test_tokenizer_config_default_is_auto_and_kinds_check_path():
    assert TokenizerConfig().kind == "auto"
    with pytest.raises(ValueError, match="tokenizer.path is required for kind 'sentencepiece'"):
        TokenizerConfig(kind="sentencepiece")


def test_auto_takes_the_model_folders_tokenizer_else_char(hf_dir, tmp_path):
    auto = TokenizerConfig()
    assert isinstance(build_tokenizer(auto), CharTokenizer)
    assert isinstance(build_tokenizer(auto, model_path=str(tmp_path)), CharTokenizer)  # a folder without tokenizer files
    assert isinstance(build_tokenizer(auto, model_path=str(tmp_path / "missing")), CharTokenizer)
    from_model = build_tokenizer(auto, model_path=hf_dir)
    assert isinstance(from_model, HFTokenizer) and from_model.path == hf_dir
    # one file is enough to mark an HF folder (tokenizer.json alone names no eos, so HFTokenizer refuses it)
    only_json = tmp_path / "only_json"
    only_json.mkdir()
    shutil.copy(f"{hf_dir}/tokenizer.json", only_json)
    with pytest.raises(ValueError, match="only_json' has no eos token"):
        build_tokenizer(auto, model_path=str(only_json))
    # an explicit kind wins over the model folder
    assert isinstance(build_tokenizer(TokenizerConfig(kind="char"), model_path=hf_dir), CharTokenizer)
    # `path` of kind auto is used before the model folder, and must hold a tokenizer
    assert isinstance(build_tokenizer(TokenizerConfig(path=hf_dir), model_path=str(tmp_path)), HFTokenizer)
    with pytest.raises(ValueError, match="is not a folder holding tokenizer.json"):
        build_tokenizer(TokenizerConfig(path=str(tmp_path)), model_path=hf_dir)


def test_check_vocab_allows_padded_model_vocab_and_names_both_sides():
    tok = CharTokenizer()
    check_vocab(tok, 99, "actor.path 'x'")
    check_vocab(tok, 128, "actor.path 'x'")  # HF pads embeddings to a multiple of 64 / 128: all 99 ids fit
    with pytest.raises(ValueError, match=r"tokenizer \(char, 99 ids\) does not match actor.path 'x' \(vocab_size 98\)"
                                         r": the model has no rows for ids 98..98"):
        check_vocab(tok, 98, "actor.path 'x'")
    with pytest.raises(ValueError, match="model.path 'y': vocab_size must be a positive int, got 0"):
        check_vocab(tok, 0, "model.path 'y'")


def test_hf_vocab_size_counts_added_tokens(hf_dir, tmp_path):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(hf_dir)
    hf.add_special_tokens({"additional_special_tokens": ["<|im_end|>"]})
    hf.save_pretrained(str(tmp_path))
    tok = HFTokenizer(str(tmp_path))
    assert tok.encode("<|im_end|>") == [50] and tok.vocab_size == 51
    with pytest.raises(ValueError, match=r"tokenizer \(hf '.*', 51 ids\) does not match m \(vocab_size 50\)"):
        check_vocab(tok, 50, "m")


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "mistral"])
def test_saved_char_tokenizer_loads_back_beside_any_model_config(tmp_path, model_type):
    """A CharTokenizer saved into an HF export folder loads back with the same ids, whatever model
    family's config.json sits beside it (transformers 5's AutoTokenizer would pick Qwen2Tokenizer
    for qwen2 and add an <|endoftext|> id the exported model has no row for)."""
    char = CharTokenizer()
    char.save(str(tmp_path))
    (tmp_path / "config.json").write_text(f'{{"model_type": "{model_type}"}}')
    hf = HFTokenizer(str(tmp_path))
    assert hf.vocab_size == char.vocab_size
    text = "12+30=\\boxed{42}\n"
    assert hf.encode(text, add_bos=True) == char.encode(text, add_bos=True)
    assert hf.decode(char.encode(text)) == text
    assert (hf.eos_id, hf.pad_id, hf.bos_id) == (char.eos_id, char.pad_id, char.bos_id)


# Qwen3's switch, cut down: the non-thinking generation prompt ends with an empty think block
THINKING_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                     "{% if add_generation_prompt %}<|assistant|>"
                     "{% if enable_thinking is defined and enable_thinking is false %}<think></think>{% endif %}"
                     "{% endif %}")


def test_enable_thinking_reaches_the_chat_template(hf_dir, tmp_path):
    path = save_char_level_hf_tokenizer(tmp_path, ["<pad>", "<s>", "</s>", "<unk>"], "abcdefghijklmnopqrstuvwxyz12+=<>|/\n",
                                        THINKING_TEMPLATE, bos_token="<s>", eos_token="</s>")
    chat = [{"role": "user", "content": "1+1="}]
    rendered = {}
    for value in ("null", "true", "false"):
        tok = build_tokenizer(load_config(TokenizerConfig, overrides=["kind=hf", f"path={path}", f"enable_thinking={value}"]))
        rendered[value] = tok.decode(tok.apply_chat_template(chat))
    assert rendered["null"] == rendered["true"] == "<|user|>1+1=\n<|assistant|>"
    assert rendered["false"] == "<|user|>1+1=\n<|assistant|><think></think>"
    with pytest.raises(ValueError, match=r"enable_thinking=False but the chat template of .* does not read enable_thinking"):
        build_tokenizer(TokenizerConfig(kind="hf", path=hf_dir, enable_thinking=False))
    with pytest.raises(ValueError, match=r"enable_thinking=True needs an HF tokenizer .* tokenizer is 'char'"):
        build_tokenizer(TokenizerConfig(enable_thinking=True))


def test_char_tokenizer_saved_with_a_larger_vocabulary_keeps_its_ids(tmp_path):
    """save(path, vocab_size) fills the vocabulary to a model's row count with tokens encoding never produces."""
    char = CharTokenizer()
    char.save(str(tmp_path), vocab_size=151)
    hf = HFTokenizer(str(tmp_path))
    assert hf.vocab_size == 151
    text = "7*6=\\boxed{42}"
    assert hf.encode(text, add_bos=True) == char.encode(text, add_bos=True)
    assert hf.decode(char.encode(text)) == text
    with pytest.raises(ValueError, match="vocab_size 50 < the character tokenizer's 99 ids"):
        char.save(str(tmp_path / "small"), vocab_size=50)
