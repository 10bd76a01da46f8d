"""The character tokenizer (hand-worked ids) and the HF wrapper on a tokenizer built offline."""
import pytest

from megalign.config import load_config
from megalign.data import CharTokenizer, HFTokenizer, TokenizerConfig, build_tokenizer


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


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny word-level (one token per character) HF tokenizer with a chat template, saved locally."""
    pytest.importorskip("transformers")  # an optional dependency: only HFTokenizer needs it
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for ch in "abcdefghijklmnopqrstuvwxyz0123456789+-*=<>|/ \n":
        vocab[ch] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    core.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = (
        "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    path = tmp_path_factory.mktemp("hf_tok")
    fast.save_pretrained(str(path))
    return str(path)


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
