"""`tokenizer_fingerprint`: equal for the same tokenizer read twice (and for the character tokenizer and its export),
different in exactly the part that changed: one token, a special token, the normaliser."""
import pytest
from data.hf_tok_fixtures import save_char_level_hf_tokenizer

from megalign.data import CharTokenizer, HFTokenizer
from megalign.data.tokenizer import FINGERPRINT_PARTS, SentencePieceTokenizer, tokenizer_fingerprint

SPECIALS = ("<unk>", "<s>", "</s>")
CHARS = "abcdefgh 0123456789"
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def fast(path, specials=SPECIALS, chars=CHARS, eos="</s>", normalizer=None):
    """A one-token-per-character HF fast tokenizer at `path` [with a `tokenizers` normaliser]."""
    save_char_level_hf_tokenizer(path, specials, chars, TEMPLATE, bos_token="<s>", eos_token=eos)
    if normalizer is not None:
        from transformers import PreTrainedTokenizerFast
        tok = PreTrainedTokenizerFast.from_pretrained(str(path))
        tok.backend_tokenizer.normalizer = normalizer
        tok.save_pretrained(str(path))
    return HFTokenizer(str(path))


def differing(a, b):
    fa, fb = tokenizer_fingerprint(a), tokenizer_fingerprint(b)
    assert set(fa) == set(fb) == set(FINGERPRINT_PARTS)
    return [part for part in FINGERPRINT_PARTS if fa[part] != fb[part]]


def test_same_folder_twice_is_equal(tmp_path):
    fast(tmp_path / "a")
    assert differing(HFTokenizer(str(tmp_path / "a")), HFTokenizer(str(tmp_path / "a"))) == []
    fast(tmp_path / "b")  # the same tokenizer written again elsewhere
    assert differing(HFTokenizer(str(tmp_path / "a")), HFTokenizer(str(tmp_path / "b"))) == []


def test_one_token_changed_differs_in_the_vocabulary(tmp_path):
    a, b = fast(tmp_path / "a"), fast(tmp_path / "b", chars=CHARS.replace("h", "z"))
    assert a.vocab_size == b.vocab_size
    assert differing(a, b) == ["vocabulary"]


def test_same_vocabulary_in_another_order_differs(tmp_path):
    a, b = fast(tmp_path / "a"), fast(tmp_path / "b", chars=CHARS[::-1])
    assert a.hf.get_vocab().keys() == b.hf.get_vocab().keys()
    assert differing(a, b) == ["vocabulary"]


def test_another_special_token_differs_in_the_special_tokens(tmp_path):
    a, b = fast(tmp_path / "a"), fast(tmp_path / "b", eos="<s>")  # EOS is id 1 instead of 2
    assert differing(a, b) == ["special tokens"]


def test_another_normaliser_differs_in_the_normaliser(tmp_path):
    from tokenizers import normalizers
    a, b = fast(tmp_path / "a"), fast(tmp_path / "b", normalizer=normalizers.Lowercase())
    assert a.encode("abc") == b.encode("abc")  # same ids here, but "ABC" would not be
    assert differing(a, b) == ["normaliser"]


def test_char_tokenizer_is_its_export(tmp_path):
    CharTokenizer().save(str(tmp_path))
    assert differing(CharTokenizer(), HFTokenizer(str(tmp_path))) == []
    CharTokenizer().save(str(tmp_path / "padded"), vocab_size=128)  # filler tokens: other ids exist
    assert differing(CharTokenizer(), HFTokenizer(str(tmp_path / "padded"))) == ["vocabulary"]


def test_sentencepiece_same_file_equal_and_another_model_differs(tmp_path):
    pytest.importorskip("sentencepiece")
    from data.sp_fixtures import train_sentencepiece
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a, b = train_sentencepiece(str(tmp_path / "a")), train_sentencepiece(str(tmp_path / "b"), pad=True)
    assert differing(SentencePieceTokenizer(a), SentencePieceTokenizer(a)) == []
    assert "special tokens" in differing(SentencePieceTokenizer(a), SentencePieceTokenizer(b))
