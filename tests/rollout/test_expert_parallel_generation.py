"""Generation at ep > 1 (`megalign.rollout.generate.ExpertLockstep`), on gloo with 2 processes and a tiny Qwen3-MoE.

References that can fail: each rank's outputs at ep = 2 (2 of the 4 experts per rank, tokens exchanged by
all-to-all) against the same calls on the whole model at ep = 1 in the same process: the rollout engine's samples,
log-probs and recorded routing, `generate`'s greedy tokens, held-out evaluation's responses, with the ranks given
different prompt counts, lengths and budgets (one rank done long before the other, or given no prompts at all); a
forward of zero tokens beside a real one (the dispatch with zero counts); a GRPO run at ep = 2, dp = 2 sampling
live (with routing replay and held-out evaluation on uneven ranks) against the run at ep = 1, dp = 2 to
the tolerances of `tests/parallel/test_expert_parallel_layout.py`; multi-turn episodes refused at ep > 1.
"""
import json
import os

import pytest
import torch
import torch.distributed as dist
from parallel.dist_utils import run_distributed
from torch.testing import assert_close
from trainers.grpo_helpers import tiny_config
from trainers.test_moe_online import tiny_moe
from transformers import AutoModelForCausalLM

from megalign.config import load_config
from megalign.data import CharTokenizer, PromptExample
from megalign.models import from_pretrained
from megalign.parallel.layout import ParallelLayout
from megalign.rollout import EngineConfig, SamplingParams, generate, rollout
from megalign.rollout.generate import ExpertLockstep
from megalign.rollout.routing import RoutingRecorder
from megalign.trainers.episodes import check_episode_setup
from megalign.trainers.evaluation import EvalConfig, evaluate_generation
from megalign.trainers.grpo import GRPOConfig, GRPOTrainer
from megalign.trainers.online_config import check_actor

LOGP_TOL = dict(rtol=1e-5, atol=1e-5)  # fp32: the experts' grouped matmuls run over other row counts at ep = 2
LR = 1e-2
ADAM_TOL = dict(rtol=0, atol=LR / 100)  # as tests/parallel/test_expert_parallel_layout.py


def _prompts(tok, texts):
    """Left-padded prompt ids and mask `[U, P]` of `texts`."""
    rows = [tok.encode(t) for t in texts]
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), tok.pad_id)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r)
        mask[i, width - len(r):] = 1
    return ids, mask


# rank 0: three prompts of different lengths, long budgets, two slots (samples admitted while others decode, one
# prompt per prefill chunk); rank 1: one prompt and a budget of two tokens, so it is done long before rank 0
CASES = [dict(texts=["12+7=", "3*4=", "19-11+2="], max_new=12, engine=EngineConfig(max_batch=2, sync_every=2,
                                                                                   prefill_batch=1)),
         dict(texts=["5+5="], max_new=2, engine=EngineConfig(sync_every=3))]


def _generation(path):
    rank = dist.get_rank()
    tok = CharTokenizer()
    reference = from_pretrained(path).eval()  # every expert on this rank: the ep = 1 result
    layout = ParallelLayout.build(ep=2)
    model = from_pretrained(path, layout=layout).eval()
    assert model.model.layers[0].mlp.experts.gate_proj.shape[0] == 2
    case = CASES[rank]
    ids, mask = _prompts(tok, case["texts"])

    # the dispatch with zero tokens: rank 1 forwards none while rank 0 forwards its prompts
    with torch.no_grad():
        if rank == 0:
            assert_close(model.model(ids, mask), reference.model(ids, mask), **LOGP_TOL)
        else:
            assert model.model(ids[:0], mask[:0]).shape == (0, ids.shape[1], 32)

    params = SamplingParams(max_new_tokens=case["max_new"], temperature=1.0, top_k=20)
    outs = []
    for m in (model, reference):
        recorder = RoutingRecorder()
        out, stats = rollout(m, ids, mask, 3, params, seed=11, config=case["engine"], routing=recorder)
        outs.append((out, recorder.sequences))
    (out, routes), (ref, ref_routes) = outs
    assert out.sequences.shape[1] == ids.shape[1] + case["max_new"]
    assert torch.equal(out.sequences, ref.sequences) and torch.equal(out.attention_mask, ref.attention_mask)
    assert_close(out.logprobs, ref.logprobs, **LOGP_TOL)
    assert torch.equal(routes, ref_routes)

    greedy = SamplingParams(max_new_tokens=case["max_new"] - 1, temperature=0.0)
    out, ref = generate(model, ids, mask, greedy), generate(reference, ids, mask, greedy)
    assert torch.equal(out.sequences, ref.sequences)
    assert_close(out.logprobs, ref.logprobs, **LOGP_TOL)

    # a rank given no prompts idles through the other's whole generation
    if rank == 0:
        out, ref = generate(model, ids, mask, greedy), generate(reference, ids, mask, greedy)
        assert torch.equal(out.sequences, ref.sequences)
    else:
        ExpertLockstep(model, ids.device).drain()

    # held-out evaluation: 5 examples over dp = 2 in batches of 1, so rank 0 generates three batches, rank 1 two
    examples = [PromptExample(tok.encode(t), t, 0, {}, f"row {i}")
                for i, t in enumerate(["1+1=", "2*3=", "4-2=", "17+3=", "9*9="])]
    cfg = EvalConfig(batch_size=1, max_new_tokens=6)
    ref_layout = ParallelLayout.build()  # ep = 1, dp = 2: the same examples per rank
    (accuracy, samples), (ref_accuracy, ref_samples) = (
        evaluate_generation(m, examples, tok, cfg, 6, lay) for m, lay in ((model, layout), (reference, ref_layout)))
    assert [s[0] for s in samples] == [e.prompt_text for e in examples[rank::2]]
    assert samples == ref_samples and accuracy == ref_accuracy


def test_generation_at_ep2_equals_ep1(tmp_path):
    policy = tiny_moe(tmp_path / "policy", k=2)
    run_distributed(_generation, policy, timeout_s=120)


def _metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _grpo(policy, root, *overrides):
    runs = {}
    for ep in (1, 2):
        runs[ep] = os.path.join(root, f"ep{ep}")
        trainer = GRPOTrainer(tiny_config(policy, runs[ep], f"actor.ep={ep}", "optim.grad_clip=0.5", f"optim.lr={LR}",
                                          "export_hf=true", "actor.routing_replay=true", "eval.max_samples=3",
                                          "eval.batch_size=1", "rollout.engine.max_batch=8", "rollout.pack=false",
                                          *overrides))
        assert trainer.train().updates == 2
    if dist.get_rank() == 0:
        one, two = _metrics(runs[1]), _metrics(runs[2])
        steps = [(a, b) for a, b in zip(one, two) if "actor/grad_norm" in a]
        assert len(steps) == 2
        for a, b in steps:
            assert a["reward/mean"] == b["reward/mean"] and a["rollout/prefill_tokens"] == b["rollout/prefill_tokens"]
            assert_close(b["actor/grad_norm"], a["actor/grad_norm"], rtol=1e-5, atol=0)
            assert a["actor/grad_norm"] > 0.5  # clipped: the weights depend on the norm
            # the rollout's log-probs against the trainer's recomputation: fp32 rounding apart at either ep
            assert max(a["rollout/logprob_max_abs_diff"], b["rollout/logprob_max_abs_diff"]) < 1e-5
        evals = [[row["eval/accuracy"] for row in rows if "eval/accuracy" in row] for rows in (one, two)]
        assert evals[0] and evals[0] == evals[1]  # the responses themselves are compared in _generation
        ma, mb = (dict(AutoModelForCausalLM.from_pretrained(os.path.join(runs[ep], "hf")).named_parameters())
                  for ep in (1, 2))
        assert ma.keys() == mb.keys() and any(".experts." in n for n in ma)
        for name in ma:
            assert_close(mb[name], ma[name], **ADAM_TOL, msg=lambda m: f"{name}: {m}")
    dist.barrier()


def test_grpo_at_ep2_samples_and_trains_as_ep1(tmp_path):
    policy = tiny_moe(tmp_path / "policy", k=2)
    run_distributed(_grpo, policy, str(tmp_path), timeout_s=180)


def test_packed_forwards_and_dynamic_sampling_refused_at_ep2(tmp_path):
    with pytest.raises(ValueError, match=r"actor\.ep=2 needs rollout\.pack=false"):
        check_actor(load_config(GRPOConfig, None, [f"run_dir={tmp_path}", "actor.ep=2"]), "cpu", False)
    with pytest.raises(ValueError, match=r"actor\.ep=2 needs algo\.dynamic_sampling=false"):
        check_actor(load_config(GRPOConfig, None, [f"run_dir={tmp_path}", "actor.ep=2", "rollout.pack=false",
                                                   "algo.dynamic_sampling=true"]), "cpu", False)


def test_multiturn_refused_at_ep2():
    tools = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "grpo_tools_arith.yaml")
    cfg = load_config(GRPOConfig, tools, ["actor.ep=2"])
    with pytest.raises(ValueError, match=r"rollout\.env: multi-turn episodes run at actor\.ep=1 for now \(got "
                                         r"actor\.ep=2\)"):
        check_episode_setup(cfg)
