"""SentencePieceTokenizer on a model trained here, against `sentencepiece.SentencePieceProcessor` itself."""
import pytest

from megalign.data import SentencePieceTokenizer, TokenizerConfig, build_tokenizer, check_vocab

spm = pytest.importorskip("sentencepiece")
from data.sp_fixtures import train_sentencepiece  # noqa: E402

TEXTS = ["hello world", " leading space", "two  spaces\nand a newline", "1+2=3 <think>x</think>", "Über ünïcödé 🙂",
         "zzqx unseen", "a", ""]


@pytest.fixture(scope="module")
def sp_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sp")
    train_sentencepiece(str(folder))
    return str(folder)


def test_ids_and_specials_are_sentencepieces(sp_dir):
    ref = spm.SentencePieceProcessor(model_file=f"{sp_dir}/tokenizer.model")
    tok = build_tokenizer(TokenizerConfig(kind="sentencepiece", path=sp_dir))
    assert isinstance(tok, SentencePieceTokenizer) and tok.name == f"sentencepiece '{sp_dir}/tokenizer.model'"
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (ref.bos_id(), ref.eos_id(), ref.get_piece_size()) == (1, 2, 300)
    assert tok.pad_id == 2  # the model has no pad piece: pad with EOS, as HFTokenizer does
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == ref.encode(text), text
        assert tok.encode(text, add_bos=True) == [1] + ids
        assert tok.decode(ids) == ref.decode(ids) == text, text  # identity normalisation + byte fallback: exact
    check_vocab(tok, 320, "model")
    with pytest.raises(ValueError, match=r"tokenizer \(sentencepiece '.*tokenizer.model', 300 ids\)"):
        check_vocab(tok, 256, "model")


def test_decode_specials_and_bad_ids(sp_dir):
    tok = build_tokenizer(TokenizerConfig(kind="sentencepiece", path=f"{sp_dir}/tokenizer.model"))
    hello = tok.encode("hello")
    assert tok.decode([1] + hello + [2]) == "hello"
    assert tok.decode([1] + hello + [2] + hello, skip_special=False) == "<s>hello</s>hello"
    with pytest.raises(ValueError, match="cannot decode id 300: vocab_size is 300"):
        tok.decode([300])


def test_pad_piece_is_used_when_the_model_has_one(tmp_path):
    train_sentencepiece(str(tmp_path), pad=True)
    tok = SentencePieceTokenizer(f"{tmp_path}/tokenizer.model")
    assert (tok.pad_id, tok.eos_id) == (3, 2)


def test_auto_reads_a_bare_tokenizer_model_and_refuses_chat(sp_dir, tmp_path):
    tok = build_tokenizer(TokenizerConfig(), model_path=sp_dir)
    assert isinstance(tok, SentencePieceTokenizer)
    with pytest.raises(ValueError, match="has no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="no SentencePiece model at"):
        build_tokenizer(TokenizerConfig(kind="sentencepiece", path=str(tmp_path)))
    (tmp_path / "tokenizer.model").write_bytes(b"not a model")
    with pytest.raises(ValueError, match="cannot read as a SentencePiece model"):
        build_tokenizer(TokenizerConfig(kind="sentencepiece", path=str(tmp_path)))
