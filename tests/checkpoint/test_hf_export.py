"""HF export with the run's tokenizer: transformers alone loads the tokenizer (same ids as megalign's)
and the model, and `generate` stops at the EOS of the written generation_config.json."""
import json
import os
import string

import pytest
import torch
from parallel.dist_utils import run_distributed

from megalign.checkpoint import export_hf
from megalign.data import CharTokenizer, HFTokenizer
from megalign.models import CausalLM, ModelConfig, TensorParallelFactory, tensor_parallel_config
from megalign.parallel.layout import ParallelLayout

transformers = pytest.importorskip("transformers")

# every character CharTokenizer knows, alone, in runs, at the edges, and texts a tokenizer could mangle
# (leading / doubled spaces, space before punctuation: HF's clean_up_tokenization_spaces would eat those)
TEXTS = [c for c in CharTokenizer.CHARS] + [
    CharTokenizer.CHARS, "".join(c for c in string.printable if c not in "\t\r\x0b\x0c"), " a", "a ", "  two  spaces  ", "x , y . z ? ' n't",
    "\n\nlines\n", "<think>12*3 = 36</think>\n<answer>-36</answer>", "{{ jinja }} {% raw %}", "<bo s>", "",
]


def tiny_model(vocab_size: int, layout=None) -> CausalLM:
    """A random untied Llama whose config.json names no eos: only generation_config.json can stop `generate`.

    With a `layout` of tp > 1, this rank's tensor-parallel shard (weights need not match across tp here).
    """
    config = ModelConfig(model_type="llama", vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=64, pad_token_id=0)
    torch.manual_seed(0)
    if layout is not None and layout.tp > 1:
        model = CausalLM(tensor_parallel_config(config, layout.tp), TensorParallelFactory(layout))
    else:
        model = CausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.5)
    return model.eval()


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("run") / "hf")
    tok = CharTokenizer()
    assert export_hf(tiny_model(tok.vocab_size), path, tokenizer=tok) == path
    return path


def test_export_writes_tokenizer_and_generation_config_atomically(exported):
    files = set(os.listdir(exported))
    assert {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= files
    assert not [f for f in files if "tmp" in f]  # the staging folder is gone
    with open(os.path.join(exported, "generation_config.json")) as f:
        assert json.load(f) == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    with open(os.path.join(exported, "config.json")) as f:
        assert "eos_token_id" not in json.load(f)


def test_char_tokenizer_through_transformers_gives_the_same_ids(exported):
    char = CharTokenizer()
    hf = transformers.AutoTokenizer.from_pretrained(exported)
    assert (hf.pad_token_id, hf.bos_token_id, hf.eos_token_id, len(hf)) == (0, 1, 2, 99)
    for text in TEXTS:
        ids = hf.encode(text, add_special_tokens=False)
        assert ids == char.encode(text), text
        assert hf.encode(text) == char.encode(text, add_bos=True), text  # BOS added as megalign adds it to prompts
        assert hf.decode(ids) == text == char.decode(ids), text
    ids = [1, 69, 3, 2, 0]
    assert hf.decode(ids, skip_special_tokens=False) == char.decode(ids, skip_special=False) == "<bos>a\n<eos><pad>"
    assert hf.decode(ids, skip_special_tokens=True) == char.decode(ids) == "a\n"
    # the documented difference: HF matches a special token's spelling in text, CharTokenizer spells it out
    assert hf.encode("<eos>", add_special_tokens=False) == [2] and len(char.encode("<eos>")) == 5


@pytest.mark.parametrize("generation_prompt", [True, False])
def test_exported_chat_template_gives_the_same_ids(exported, generation_prompt):
    char = CharTokenizer()
    hf = transformers.AutoTokenizer.from_pretrained(exported)
    conversations = [
        [{"role": "user", "content": "1+2="}],
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2*3="},
         {"role": "assistant", "content": "<answer>6</answer>"}, {"role": "user", "content": "and\n7-1?"}],
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
    ]
    for messages in conversations:
        text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        assert hf.encode(text, add_special_tokens=False) == char.apply_chat_template(messages, generation_prompt)
    # hand-worked: <bos> "user: q\n" "assistant: a" <eos>
    assert char.apply_chat_template(conversations[2], False) == [1] + char.encode("user: q\nassistant: a") + [2]


def _export_from_every_rank(path: str, tp: int) -> None:
    layout = ParallelLayout.build(tp=tp)
    tok = CharTokenizer()
    export_hf(tiny_model(tok.vocab_size, layout), path, layout, tokenizer=tok)
    # after the barrier every rank sees the complete export
    hf = transformers.AutoTokenizer.from_pretrained(path)
    assert hf.encode("1+2=\n", add_special_tokens=False) == tok.encode("1+2=\n")
    assert transformers.GenerationConfig.from_pretrained(path).eos_token_id == 2


@pytest.mark.parametrize("tp", [1, 2])  # tp=1: two dp replicas; tp=2: two shards of one model
def test_export_with_tokenizer_on_two_ranks(tmp_path, tp):
    run_distributed(_export_from_every_rank, str(tmp_path / "hf"), tp)
    assert not [f for f in os.listdir(tmp_path / "hf") if "tmp" in f]


def test_hf_tokenizer_is_saved_with_save_pretrained(exported, tmp_path):
    again = str(tmp_path / "again")
    tok = HFTokenizer(exported)
    export_hf(tiny_model(tok.vocab_size), again, tokenizer=tok)
    reloaded = transformers.AutoTokenizer.from_pretrained(again)
    for text in TEXTS[-8:]:
        assert reloaded.encode(text, add_special_tokens=False) == CharTokenizer().encode(text)
    assert reloaded.chat_template == CharTokenizer.CHAT_TEMPLATE


def test_generate_from_transformers_stops_at_the_exported_eos(exported):
    model = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
    tok = transformers.AutoTokenizer.from_pretrained(exported)
    assert model.generation_config.eos_token_id == 2 and model.generation_config.pad_token_id == 0

    def greedy_without_stopping(prompt):  # step by step, independent of generate
        ids, greedy = prompt, []
        with torch.no_grad():
            for _ in range(12):
                greedy.append(int(model(ids).logits[0, -1].argmax()))
                ids = torch.cat([ids, torch.tensor([greedy[-1:]])], dim=1)
        return greedy

    # k: the first step >= 2 whose token is new, with no EOS up to it. Swapping the head rows of that
    # token and EOS relabels the two logits, so the greedy path is unchanged until step k emits EOS.
    # The first prompt whose continuation has such a step is used (a random model may loop on one token).
    for text in ["1+2=", "hello", "abc", "xy"]:
        prompt = torch.tensor([tok.encode(text)])
        greedy = greedy_without_stopping(prompt)
        k = next((k for k in range(2, 12) if greedy[k] not in greedy[:k] and 2 not in greedy[:k + 1]), None)
        if k is not None:
            break
    assert k is not None, "no prompt has a usable greedy continuation; change the seed of tiny_model"
    with torch.no_grad():
        head = model.lm_head.weight
        head[[2, greedy[k]]] = head[[greedy[k], 2]].clone()
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False)
    assert out[0, prompt.shape[1]:].tolist() == greedy[:k] + [2]


def test_sentencepiece_tokenizer_is_exported_as_its_model_file(tmp_path):
    spm = pytest.importorskip("sentencepiece")
    from data.sp_fixtures import train_sentencepiece

    from megalign.data import SentencePieceTokenizer

    (tmp_path / "sp").mkdir()
    tok = SentencePieceTokenizer(train_sentencepiece(str(tmp_path / "sp")))
    path = export_hf(tiny_model(tok.vocab_size), str(tmp_path / "hf"), tokenizer=tok)
    ref = spm.SentencePieceProcessor(model_file=tok.path)
    hf = transformers.AutoTokenizer.from_pretrained(path)
    for text in ["hello world", " two  spaces\nline", "Über 1+2=3"]:
        ids = hf.encode(text, add_special_tokens=False)
        assert ids == ref.encode(text), text
        assert hf.decode(ids) == text
    with open(os.path.join(path, "generation_config.json")) as f:
        assert json.load(f) == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
