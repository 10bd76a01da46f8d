"""megalign.integrations.trl against TRL itself: the patched trainers give TRL's own per-token
log-probs, losses, gradients and metrics on the same tiny random Llama and the same batch, and the
patched selective_log_softmax gives TRL's results (checked against a float64 oracle on odd shapes
and dtypes). Each trainer case computes the patched result, unpatches, and computes TRL's stock
result with the same trainer and weights (the patch leaves a trainer's model on TRL's head once
it is undone). Calls into megalign's kernels are counted so a silent fallback cannot pass.
"""
import importlib
import sys

import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

import megalign.integrations.trl as patch  # noqa: E402
from conftest import assert_close_to_oracle  # noqa: E402
from megalign.integrations import apply_megalign_kernels_to_trl, megalign_kernels_in_trl, unpatch_trl  # noqa: E402

VOCAB = 97
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _unpatched():
    unpatch_trl()
    yield
    unpatch_trl()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A random 2-layer Llama (vocab 97) and a word-level tokenizer `t0 .. t96` (pad t0, eos t1)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("trl_llama")
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t1", bos_token="t2").save_pretrained(path)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


@pytest.fixture
def calls(monkeypatch):
    """Counts of megalign's head and policy-loss calls made through the patch."""
    counts = {"head": 0, "policy_loss": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(patch, "fused_linear_token_logprob", counted("head", patch.fused_linear_token_logprob))
    monkeypatch.setattr(patch, "policy_loss", counted("policy_loss", patch.policy_loss))
    return counts


def _tokenizer(model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_dir)


def _loss_and_grads(trainer, inputs):
    trainer._metrics["train"].clear()
    loss = trainer.compute_loss(trainer.model, inputs)
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params)
    return loss.detach(), grads, {k: list(v) for k, v in trainer._metrics["train"].items()}


def _assert_same_update(patched, stock, bf16=False):
    """fp32: TRL's results to fp32 rounding. bf16 autocast: the log-probs are fp32 statistics of the
    same bf16 logits on both sides, the gradients bf16 products rounded in another order (~1 bf16
    ulp of the largest entry, 2^-8 relative)."""
    (loss, grads, metrics), (ref_loss, ref_grads, ref_metrics) = patched, stock
    rel = 2 ** -7 if bf16 else 1e-5
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=10 * rel, atol=rel * r.abs().max().item() + 1e-9)
    assert metrics.keys() == ref_metrics.keys()
    for key in ref_metrics.keys() - {"num_tokens"}:  # num_tokens: a running count over calls
        assert metrics[key] == pytest.approx(ref_metrics[key], rel=1e-4, abs=1e-6), key


# ----- GRPOTrainer

def _grpo_trainer(model_dir, tmp_path, **config):
    args = trl.GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                          max_completion_length=6, report_to=[], use_cpu=True, save_strategy="no",
                          **{"bf16": False, **config})
    trainer = trl.GRPOTrainer(model=model_dir, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                              args=args, train_dataset=datasets.Dataset.from_dict({"prompt": ["t3 t4"] * 4}),
                              processing_class=_tokenizer(model_dir))
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 2
    return trainer


def _grpo_inputs(trainer, seed=0):
    """A GRPO batch as _generate_and_score_completions leaves it: left-padded prompts, right-padded
    completions, advantages of both signs, and old / reference log-probs away from the policy's
    (TRL's own log-probs plus noise), so that both clip sides are hit."""
    g = torch.Generator().manual_seed(seed)
    b, tp, tc = 4, 5, 6
    prompt_ids = torch.randint(3, VOCAB, (b, tp), generator=g)
    prompt_mask = torch.ones(b, tp, dtype=torch.long)
    prompt_mask[1, :2] = 0
    prompt_mask[3, :1] = 0
    prompt_ids[prompt_mask == 0] = 0
    completion_ids = torch.randint(3, VOCAB, (b, tc), generator=g)
    completion_mask = torch.ones(b, tc, dtype=torch.long)
    completion_mask[0, 4:] = 0
    completion_mask[2, 1:] = 0
    inputs = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
              "completion_mask": completion_mask, "advantages": torch.tensor([1.0, -0.5, 0.7, -1.2]),
              "num_items_in_batch": completion_mask.sum().float()}
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1),
            tc)
    inputs["old_per_token_logps"] = logps + 0.3 * torch.randn(logps.shape, generator=g)
    inputs["ref_per_token_logps"] = logps + 0.2 * torch.randn(logps.shape, generator=g)
    return inputs


@pytest.mark.parametrize("config, routed", [
    (dict(loss_type="dapo", beta=0.0), True),
    (dict(loss_type="dapo", beta=0.0, bf16=True), True),  # TRL's default: bf16 autocast (on the CPU too)
    (dict(loss_type="grpo", beta=0.04, epsilon_high=0.28, use_bias_correction_kl=False), True),
    (dict(loss_type="dr_grpo", beta=0.0, delta=1.5), True),
    (dict(loss_type="bnpo", beta=0.04, use_bias_correction_kl=False), True),
    (dict(loss_type="luspo", beta=0.0), True),
    (dict(loss_type="cispo", beta=0.0, epsilon_high=5.0), False),  # another formula: TRL's loss, megalign's head
    (dict(loss_type="grpo", beta=0.0, top_entropy_quantile=0.5), False),
    (dict(loss_type="dapo", beta=0.04), False),  # TRL's default use_bias_correction_kl: k3 * ratio
    (dict(loss_type="dapo", beta=0.0, delta=1.1), False),  # delta <= 1 + epsilon_high
])
def test_grpo_update_matches_trl(model_dir, tmp_path, calls, config, routed):
    apply_megalign_kernels_to_trl()
    trainer = _grpo_trainer(model_dir, tmp_path, **config)
    inputs = _grpo_inputs(trainer)
    calls["head"] = 0
    patched = _loss_and_grads(trainer, inputs)
    assert calls["head"] == 1 and calls["policy_loss"] == int(routed)
    unpatch_trl()
    stock = _loss_and_grads(trainer, inputs)
    assert calls["head"] == 1 and calls["policy_loss"] == int(routed)
    _assert_same_update(patched, stock, bf16=config.get("bf16", False))


def test_grpo_per_token_logps_and_entropy_match_trl(model_dir, tmp_path, calls):
    apply_megalign_kernels_to_trl(chunk_size=5)  # several chunks over the 17 labelled positions
    trainer = _grpo_trainer(model_dir, tmp_path, loss_type="dapo", temperature=0.7)
    inputs = _grpo_inputs(trainer, seed=1)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    att = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)

    def run():
        logps, entropy, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, att, 6, compute_entropy=True)
        return logps, entropy

    calls["head"] = 0
    logps, entropy = run()
    assert calls["head"] == 1
    unpatch_trl()
    ref_logps, ref_entropy = run()
    mask = inputs["completion_mask"].bool()
    torch.testing.assert_close(logps[mask], ref_logps[mask], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy[mask], ref_entropy[mask], rtol=1e-5, atol=1e-5)
    assert (logps[~mask] == 0).all() and (ref_logps[~mask] == 0).all()


def test_all_unlabelled_batch_gives_a_zero_loss_that_backpropagates(model_dir, tmp_path, calls):
    apply_megalign_kernels_to_trl()
    model = _grpo_trainer(model_dir, tmp_path, loss_type="dapo").model
    ids = torch.randint(3, VOCAB, (2, 5))
    out = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=torch.full_like(ids, -100),
                fused_lm_head=True)
    assert calls["head"] == 1 and out.label_mask.shape == (2, 4) and not out.label_mask.any()
    assert (out.log_probs == 0).all() and (out.entropy == 0).all() and out.loss == 0
    out.loss.backward()
    assert all(p.grad is None or (p.grad == 0).all() for p in model.parameters())


def test_trainer_built_before_the_patch_keeps_trl_head(model_dir, tmp_path, calls):
    trainer = _grpo_trainer(model_dir, tmp_path, loss_type="dapo")
    inputs = _grpo_inputs(trainer)
    apply_megalign_kernels_to_trl(policy_loss=False)
    trainer.compute_loss(trainer.model, inputs)
    assert calls == {"head": 0, "policy_loss": 0}


# ----- DPOTrainer

def _dpo_batch(trainer):
    return next(iter(trainer.get_train_dataloader()))


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_dpo_update_matches_trl(model_dir, tmp_path, calls, loss_type):
    apply_megalign_kernels_to_trl()
    data = datasets.Dataset.from_dict({"prompt": ["t3 t4", "t5 t6 t7", "t8"],
                                       "chosen": [" t9 t10 t11", " t12", " t13 t14"],
                                       "rejected": [" t15", " t16 t17 t18 t19", " t20 t21"]})
    args = trl.DPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=3, report_to=[], use_cpu=True,
                         save_strategy="no", loss_type=[loss_type], beta=0.3, bf16=False)
    trainer = trl.DPOTrainer(model=model_dir, args=args, train_dataset=data, processing_class=_tokenizer(model_dir))
    trainer.model.train()
    with torch.no_grad():  # a reference away from the policy, so the loss is not at its symmetric point
        for p in trainer.ref_model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    inputs = _dpo_batch(trainer)
    patched = _loss_and_grads(trainer, inputs)
    assert calls["head"] == 2  # policy and reference forwards
    unpatch_trl()
    stock = _loss_and_grads(trainer, inputs)
    assert calls["head"] == 2
    _assert_same_update(patched, stock)


def test_dpo_head_metrics_match_trl(model_dir, tmp_path, calls):
    """mean_logits and is_top1 (DPO's logits/* and token-accuracy metrics) on targets half of which
    are the model's argmax, so that is_top1 is not trivially all False."""
    apply_megalign_kernels_to_trl(chunk_size=3)
    data = datasets.Dataset.from_dict({"prompt": ["t3"], "chosen": [" t9"], "rejected": [" t15"]})
    args = trl.DPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, save_strategy="no", bf16=False)
    model = trl.DPOTrainer(model=model_dir, args=args, train_dataset=data, processing_class=_tokenizer(model_dir)).model
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, VOCAB, (2, 9), generator=g)
    with torch.no_grad():
        top = model(input_ids=ids).logits.argmax(-1)  # TRL's forward without fused_lm_head: the model's own
    labels = torch.randint(3, VOCAB, (2, 9), generator=g)
    labels[:, 1::2] = top[:, :-1:2]
    labels[0, :3] = -100

    def run():
        with torch.no_grad():
            return model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels, fused_lm_head=True)

    out = run()
    assert calls["head"] == 1
    unpatch_trl()
    ref = run()
    assert ref.is_top1.sum() >= 7
    assert torch.equal(out.is_top1, ref.is_top1) and torch.equal(out.label_mask, ref.label_mask)
    torch.testing.assert_close(out.mean_logits, ref.mean_logits, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.log_probs, ref.log_probs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.entropy, ref.entropy, rtol=1e-5, atol=1e-6)


def test_dpo_wpo_weighting_falls_back_to_trl(model_dir, tmp_path, calls):
    apply_megalign_kernels_to_trl()
    data = datasets.Dataset.from_dict({"prompt": ["t3 t4"], "chosen": [" t9 t10"], "rejected": [" t15"]})
    args = trl.DPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=1, report_to=[], use_cpu=True,
                         save_strategy="no", use_weighting=True, bf16=False)
    trainer = trl.DPOTrainer(model=model_dir, args=args, train_dataset=data, processing_class=_tokenizer(model_dir))
    trainer.compute_loss(trainer.model, _dpo_batch(trainer))
    assert calls["head"] == 1  # the reference model needs only log-probs; the policy's log_sum_sq_probs is TRL's


# ----- selective_log_softmax

def _oracle_logp(logits, index, temperature, row_mask):
    logp = torch.log_softmax(logits.double() / temperature, -1).gather(-1, index.unsqueeze(-1)).squeeze(-1)
    return logp if row_mask is None else logp.masked_fill(row_mask == 0, 0.0)


@pytest.mark.parametrize("shape, dtype, temperature, masked", [
    ((1, 1, 7), torch.float32, 1.0, False),
    ((3, 5, 97), torch.float32, 0.7, True),
    ((2, 4, 1), torch.float32, 1.0, False),        # a one-id vocabulary: logp = 0
    ((4, 131), torch.float64, 1.3, True),          # 2-d logits, fp64
    ((2, 3, 257), torch.bfloat16, 1.0, True),
    ((5, 2, 211), torch.float16, 0.9, False),
])
def test_selective_log_softmax_matches_trl(shape, dtype, temperature, masked):
    from trl.trainer import utils
    stock = utils.selective_log_softmax
    g = torch.Generator().manual_seed(sum(shape))
    logits = (4 * torch.randn(shape, generator=g, dtype=torch.float64)).to(dtype)
    index = torch.randint(0, shape[-1], shape[:-1], generator=g)
    if shape[-1] > 1:  # a -inf logit (masked-out id) in the first row, whose target is another id
        logits.view(-1, shape[-1])[0, 0] = -float("inf")
        index.view(-1)[0] = 1
    row_mask = (torch.rand(shape[:-1], generator=g) > 0.3).long() if masked else None
    weights = torch.randn(shape[:-1], generator=g, dtype=torch.float64)

    def value_and_grad(fn, x):
        x = x.detach().requires_grad_()
        out = fn(x, index, temperature=temperature, row_mask=row_mask)
        (grad,) = torch.autograd.grad((out.double() * weights).sum(), x)
        return out, grad

    ref_out, ref_grad = value_and_grad(stock, logits)
    oracle_out, oracle_grad = value_and_grad(lambda x, i, **kw: _oracle_logp(x, i, **kw), logits.double())
    with megalign_kernels_in_trl():
        assert utils.selective_log_softmax is not stock
        out, grad = value_and_grad(utils.selective_log_softmax, logits)
    assert utils.selective_log_softmax is stock
    assert out.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert grad.dtype == dtype
    assert_close_to_oracle(out, oracle_out, ref_out, name="logp")
    assert_close_to_oracle(grad, oracle_grad, ref_grad, name="grad")


def test_selective_log_softmax_and_entropy_and_top_k():
    from trl.trainer import utils
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, 53, generator=g, dtype=torch.float64)
    index = torch.randint(0, 53, (3, 4), generator=g)
    top_k = torch.randint(0, 53, (3, 4, 2), generator=g)
    ref_logp, ref_entropy = utils.selective_log_softmax_and_entropy(logits, index, temperature=0.8)
    ref_top_k = utils.selective_log_softmax(logits, top_k)
    with megalign_kernels_in_trl():
        logp, entropy = utils.selective_log_softmax_and_entropy(logits, index, temperature=0.8)
        top_k_logp = utils.selective_log_softmax(logits, top_k)  # [..., K]: TRL's own function
        with pytest.raises(ValueError, match="temperature must be positive"):
            utils.selective_log_softmax(logits, index, temperature=0.0)
    torch.testing.assert_close(logp, ref_logp, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(entropy, ref_entropy, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(top_k_logp, ref_top_k, rtol=0, atol=0)


def test_selective_log_softmax_replaced_where_imported_by_name():
    import trl.experimental.orpo.orpo_trainer as orpo
    stock = orpo.selective_log_softmax
    with megalign_kernels_in_trl(lm_head=False, policy_loss=False):
        assert orpo.selective_log_softmax is trl.trainer.utils.selective_log_softmax is not stock
    assert orpo.selective_log_softmax is stock


# ----- the patch itself

def test_unpatch_restores_every_name():
    import trl.trainer.dpo_trainer as dpo
    import trl.trainer.grpo_trainer as grpo
    before = (grpo.add_fused_lm_head, dpo.add_fused_lm_head, grpo.GRPOTrainer._compute_loss,
              trl.trainer.utils.selective_log_softmax)
    apply_megalign_kernels_to_trl()
    apply_megalign_kernels_to_trl(chunk_size=8)  # a second call replaces the first
    assert grpo.add_fused_lm_head is not before[0] and grpo.GRPOTrainer._compute_loss is not before[2]
    unpatch_trl()
    assert (grpo.add_fused_lm_head, dpo.add_fused_lm_head, grpo.GRPOTrainer._compute_loss,
            trl.trainer.utils.selective_log_softmax) == before


def test_bad_arguments_and_missing_trl(monkeypatch):
    with pytest.raises(ValueError, match="chunk_size"):
        apply_megalign_kernels_to_trl(chunk_size=0)
    monkeypatch.setitem(sys.modules, "trl", None)
    with pytest.raises(ImportError, match="needs TRL"):
        apply_megalign_kernels_to_trl()


def test_megalign_import_does_not_import_trl(monkeypatch):
    monkeypatch.setitem(sys.modules, "trl", None)  # any `import trl` now raises ImportError
    importlib.reload(patch)
    importlib.reload(sys.modules["megalign.integrations"])
