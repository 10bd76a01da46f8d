"""The planner with pipeline stages of uneven size: 28-layer Qwen2.5-7B at pp = 8 plans with Megatron's first / last
stage layer counts (or a list) and is refused without them; each stage holds its own layers' parameters (worked by
hand from the architecture) and the plan's peak is the heaviest stage; run configs and the command line carry the
options."""
import os

import pytest

from megalign.plan.__main__ import main
from megalign.plan.model import PRESETS, stage_params, total_params
from megalign.plan.planner import PlanConfig, Planner, RolePlan, plan_memory
from megalign.plan.runconfig import plan_from_run_config
from megalign.parallel import StageSplit

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QWEN = PRESETS["qwen2.5-7b"]
# one Qwen2.5-7B layer (h 3584, 28 query / 4 kv heads of 128, SwiGLU 18944, q/k/v biases):
# q, k, v, o: 3584 * (3584 + 512 + 512 + 3584) + biases 3584 + 512 + 512; MLP 3 * 3584 * 18944; two norms 2 * 3584
LAYER = 3584 * 8192 + 4608 + 3 * 3584 * 18944 + 2 * 3584
VOCAB_ROWS = 152064 * 3584  # embedding, and the untied LM head


def _plan(actor: RolePlan, **fields) -> PlanConfig:
    return PlanConfig(model="qwen2.5-7b", algorithm="sft", gpus=8, actor=actor, **fields)


def test_28_layers_at_pp8_refused_without_the_options():
    with pytest.raises(ValueError, match=r"num_hidden_layers=28 is not divisible by pp=8; set actor.first_stage_layers "
                                         r"/ actor.last_stage_layers or actor.stage_layers, e.g. "
                                         r"\[3, 3, 4, 4, 4, 4, 3, 3\]"):
        plan_memory(_plan(RolePlan(pp=8)))
    with pytest.raises(ValueError, match=r"actor.stage_layers=\[4(, 4){7}\] sums to 32, not the model's 28"):
        plan_memory(_plan(RolePlan(pp=8, stage_layers=[4] * 8)))
    with pytest.raises(ValueError, match=r"stage_layers=\[4, 4\] has 2 entries but pp=8"):
        RolePlan(pp=8, stage_layers=[4, 4])


def test_each_stage_holds_its_own_layers_by_hand():
    assert LAYER == 233_057_792
    split = StageSplit(first_stage_layers=2, last_stage_layers=2)  # [2, 4, 4, 4, 4, 4, 4, 2]
    stages = [stage_params(QWEN, 1, 8, s, split=split) for s in range(8)]
    assert [s.layers for s in stages] == [2, 4, 4, 4, 4, 4, 4, 2]
    assert stages[0].total == 2 * LAYER + VOCAB_ROWS
    assert all(s.total == 4 * LAYER for s in stages[1:7])
    assert stages[7].total == 2 * LAYER + VOCAB_ROWS + 3584  # the head and the final norm
    assert sum(s.total for s in stages) == total_params(QWEN) == 7_615_616_512  # the published count


def test_the_plan_is_the_heaviest_stage_and_fewer_end_layers_lower_it():
    """Megatron's reason for first / last stage counts: the first stage holds the embedding and keeps pp micro-batches
    in flight (1F1B), so its layers weigh most; moving layers off it lowers the peak."""
    fields = dict(prompt_length=1024, response_length=1024, micro_batch_size=2, prompts_per_step=64)
    peaks = {}
    for split in ([2, 4, 4, 4, 4, 4, 4, 2], [7, 3, 3, 3, 3, 3, 3, 3]):
        plan = _plan(RolePlan(pp=8, stage_layers=split), **fields)
        planner, estimate = Planner(plan), plan_memory(plan)
        update = next(r for r in estimate.rows if r.step.kind == "update")
        stage, got = update.roles["actor"]
        per_stage = [planner.role_bytes("actor", update.step, s).total for s in range(8)]
        assert got.total == max(per_stage) and stage == per_stage.index(max(per_stage))
        weights, _, _, n = planner.states("actor", stage)
        assert n == split[stage] * LAYER + (VOCAB_ROWS if stage == 0 else 0) + (VOCAB_ROWS + 3584 if stage == 7 else 0)
        peaks[tuple(split)] = estimate.peak().total
        assert estimate.as_dict()["layout"]["actor"]["stage_layers"] == split
        assert f"pp8 layers {split}" in estimate.table()
    assert peaks[(2, 4, 4, 4, 4, 4, 4, 2)] < peaks[(7, 3, 3, 3, 3, 3, 3, 3)]


def test_run_config_and_command_line_carry_the_options(capsys):
    sft = os.path.join(ROOT, "examples", "sft_arith.yaml")
    plan, model = plan_from_run_config(sft, 8, "qwen2.5-7b", overrides=["model.pp=8", "model.first_stage_layers=2",
                                                                        "model.last_stage_layers=2"])
    assert (plan.actor.first_stage_layers, plan.actor.last_stage_layers) == (2, 2)
    assert plan_memory(plan, model).as_dict()["layout"]["actor"]["stage_layers"] == [2, 4, 4, 4, 4, 4, 4, 2]
    assert main(["--run-config", sft, "--gpus", "8", "--model", "qwen2.5-7b", "model.pp=8"]) == 2
    assert "e.g. [3, 3, 4, 4, 4, 4, 3, 3]" in capsys.readouterr().err
    assert main(["--run-config", sft, "--gpus", "8", "--model", "qwen2.5-7b", "model.pp=8",
                 "model.stage_layers=[3,3,4,4,4,4,3,3]"]) in (0, 1)
    assert "pp8 layers [3, 3, 4, 4, 4, 4, 3, 3]" in capsys.readouterr().out
