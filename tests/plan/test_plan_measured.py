"""The planner against memory measured in small CPU runs, at tp = 1 / 2 and pp = 1 / 2 (within 15%).

Two measurements:
- what the GRPO trainer logs, `memory/<phase>/<role>_mib` (`Role.resident_bytes`: the actor's weights
  and its ZeRO-1 optimizer shard on rank 0), at tp = 1 (dp = 2) and tp = 2 (dp = 1), against the
  planner's resident weights + optimizer in the same phases;
- the peak of a whole training step (forward, vocab-parallel log-prob loss, backward, gradient sync,
  ZeRO-1 AdamW step) on the engine's own model and 1F1B pipeline, measured by `PeakBytes` below (a
  `TorchDispatchMode` that sees every tensor an aten op returns and follows its storage with a weak
  reference until it is freed: the live bytes of parameters, buffers, gradients, activations,
  temporaries and optimizer state, and their peak; torch's own `MemTracker` works the same way but
  its module hooks break the pipeline's `autograd.grad` backward), on every rank, against the
  planner's update-step total of that rank's stage: (tp, pp) = (1, 1) with dp = 2, (2, 1), (1, 2)
  (stage 0 keeps two micro-batches in flight, the last stage one plus the logits).
"""
import json
import os
import weakref

import pytest
import torch
from parallel.dist_utils import run_distributed
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from trainers.grpo_helpers import tiny_config, tiny_policy

from megalign.models import CausalLM, ModelConfig, save_hf_checkpoint, stage_from_pretrained
from megalign.parallel import (ParallelLayout, Pipeline, allreduce_gradients, vocab_parallel_token_logprob,
                               zero1_optimizer)
from megalign.plan.formulas import megalign_layer_bytes
from megalign.plan.planner import PlanConfig, Planner, RolePlan, Step
from megalign.plan.runconfig import plan_from_run_config
from megalign.trainers.grpo import train_grpo

TOLERANCE = 0.15
B, P, R = 8, 40, 24  # sequences per rank and step, prompt and response tokens


class PeakBytes(TorchDispatchMode):
    """Live and peak bytes of distinct storages: those given to `track` and every tensor an op returns."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, tuple[int, weakref.ref]] = {}
        self.current = self.peak = 0

    def track(self, *tensors):
        for t in tensors:
            storage = t.untyped_storage()
            key = storage._cdata
            if key in self.live or storage.nbytes() == 0:
                continue
            self.live[key] = (storage.nbytes(), weakref.ref(storage, lambda _, key=key: self._free(key)))
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)

    def _free(self, key):
        nbytes, _ = self.live.pop(key)
        self.current -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.track(*(t for t in tree_leaves(out) if isinstance(t, torch.Tensor)))
        return out


def _saved_bytes(model, ids, mask, dtype):
    """Bytes of the distinct storages autograd saves in a forward, without the parameters and the bf16
    weight casts (2-D tensors not shaped [tokens, ...]; the planner counts those as weight copies)."""
    own = {t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers()]}
    tokens = ids.numel()
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        weight_cast = t.dim() == 2 and t.shape[0] != tokens
        if storage._cdata not in own and not weight_cast:
            seen[storage._cdata] = storage.nbytes()
        return t

    with torch.autocast("cpu", dtype, enabled=dtype == torch.bfloat16), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids, mask)
    return sum(seen.values())


@pytest.mark.parametrize("family,head_dim", [("llama", 12), ("qwen3", 16)])  # qwen3: q/k norms, head_dim != h / a
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("attention", ["flash", "sdpa"])
def test_layer_count_equals_saved_tensors(dtype, attention, family, head_dim):
    # one layer's share: a 3-layer model minus a 2-layer one (embedding, final norm and head cancel)
    b, s = 3, 40
    ids = torch.randint(0, 98, (b, s))
    mask = torch.ones_like(ids) if attention == "sdpa" else None  # no mask: SDPA's O(s) causal kernel, as flash
    saved = []
    for layers in (2, 3):
        cfg = ModelConfig(family, vocab_size=98, hidden_size=48, intermediate_size=160, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=64)
        saved.append(_saved_bytes(CausalLM(cfg), ids, mask, dtype))
    e = 2 if dtype == torch.bfloat16 else 4
    assert saved[1] - saved[0] == megalign_layer_bytes(s, b, 48, 4, 2, 160, 1, e, attention, head_dim=head_dim,
                                                       qk_norm=cfg.qk_norm)


def test_kv_cache_bytes_equal_the_allocated_cache():
    # the rollout's cache: megalign allocates it in the weights' dtype (the actor's fp32 master weights)
    cfg = ModelConfig("llama", vocab_size=98, hidden_size=48, intermediate_size=160, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=12, max_position_embeddings=64)
    plan = PlanConfig(model="small", algorithm="grpo", gpus=1, prompt_length=20, response_length=12, group_size=4,
                      prompts_per_step=3, actor=RolePlan(dtype="bf16"))
    cache = CausalLM(cfg).model.new_kv_cache(12, 32)
    allocated = sum(t.nbytes for t in [*cache.k, *cache.v])
    assert Planner(plan, cfg).role_bytes("actor", Step("rollout", "actor", "rollout"), 0).kv_cache == allocated


def _small_model(path):
    config = ModelConfig("llama", vocab_size=98, hidden_size=64, intermediate_size=176, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128)
    torch.manual_seed(0)
    save_hf_checkpoint(CausalLM(config), path)
    return config


def _loss_sum(logits, batch, layout):
    return -vocab_parallel_token_logprob(logits, batch["targets"], layout.tp_group if layout.tp > 1 else None,
                                         logits.shape[-1] * layout.tp_rank, vocab_size=98).sum()


def _measure_step(path, tp, pp, n_micro, out):
    layout = ParallelLayout.build(tp=tp, pp=pp)
    model = stage_from_pretrained(path, layout).train()
    optimizer = zero1_optimizer([p for p in model.parameters()], layout.dp_group, lr=1e-3)
    g = torch.Generator().manual_seed(layout.dp_rank)
    ids = torch.randint(0, 98, (B, P + R), generator=g)
    mask = torch.ones_like(ids)
    targets = torch.roll(ids, -1, dims=1)

    def step():
        if pp > 1:
            Pipeline(model, layout, n_micro).train_step(ids, lambda out_mb, mb: _loss_sum(out_mb, mb, layout),
                                                        ids.numel(), attention_mask=mask, batch={"targets": targets})
        else:
            (_loss_sum(model(ids, mask), {"targets": targets}, layout) / ids.numel()).backward()
        allreduce_gradients(model.parameters(), layout.dp_group)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # creates the optimizer state, as every step after the first has it
    tracker = PeakBytes()
    state = [t for st in optimizer.optim.state.values() for t in st.values() if torch.is_tensor(t)]
    tracker.track(*model.parameters(), *model.buffers(), *state)
    with tracker:
        step()
    peak = tracker.peak
    with open(os.path.join(out, f"rank{torch.distributed.get_rank()}.json"), "w") as f:
        json.dump({"peak": peak, "stage": layout.pp_rank}, f)


@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (1, 2)])
def test_training_step_peak_within_15_percent(tmp_path, tp, pp):
    config = _small_model(tmp_path / "hf")
    n_micro = 2 if pp > 1 else 1
    run_distributed(_measure_step, str(tmp_path / "hf"), tp, pp, n_micro, str(tmp_path))
    dp = 2 // (tp * pp)
    plan = PlanConfig(model="small", algorithm="sft", gpus=2, prompt_length=P, response_length=R,
                      prompts_per_step=B * dp, micro_batch_size=B // n_micro, attention="sdpa",
                      actor=RolePlan(tp=tp, pp=pp, dtype="fp32"))
    planner = Planner(plan, config)
    for rank in range(2):
        with open(tmp_path / f"rank{rank}.json") as f:
            measured = json.load(f)
        predicted = planner.role_bytes("actor", Step("update", "actor", "update"), measured["stage"]).total
        assert abs(predicted - measured["peak"]) <= TOLERANCE * measured["peak"], (rank, predicted, measured)


def _grpo(policy, run_dir, tp):
    train_grpo(tiny_config(policy, run_dir, f"actor.tp={tp}", "export_hf=false"))


@pytest.mark.parametrize("tp", [1, 2])
def test_trainer_logged_memory_within_15_percent(tmp_path, tp):
    policy = tiny_policy(tmp_path / "policy")
    run_distributed(_grpo, policy, str(tmp_path / "run"), tp)
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        row = [json.loads(line) for line in f if '"reward/mean"' in line][-1]  # step 2: the optimizer state exists
    plan, model = plan_from_run_config(str(tmp_path / "run" / "config.yaml"), gpus=2)  # the resolved config the run wrote
    planner = Planner(plan, model)
    for phase, step in (("generate", Step("rollout", "actor", "rollout")), ("update", Step("update", "actor", "update"))):
        b = planner.role_bytes("actor", step, 0)
        predicted = (b.weights + b.optimizer) / 2 ** 20
        measured = row[f"memory/{phase}/actor_mib"]
        assert abs(predicted - measured) <= TOLERANCE * measured, (phase, predicted, measured)
