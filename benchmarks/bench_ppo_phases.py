"""PPO step split by phase, with and without offload, and what the critic's serial update costs.

    python benchmarks/bench_ppo_phases.py [--quick]

One process (a one-rank gloo group), megalign's PPO trainer on a random Llama actor / reference and a
random reward model of the same shape (the critic starts from the reward model, as in
examples/ppo_arith.yaml), the embedded arithmetic prompts, P prompts x G responses of at most R tokens.
Two configurations run alternately in rounds (resident, offloaded, then offloaded, resident, ...) so
load from other processes hits both; the first step of each round is warm-up and dropped, the numbers
are medians of the rest:

- resident: all four roles stay on the device;
- offloaded: every offload switch on (actor weights and optimizer, reference, reward model, critic
  weights and optimizer), so each phase holds only its own role.

One torch thread by default (`--threads`), as each rank of a `torchrun` run has. Reported per phase: median seconds (`time/<phase>` metrics of the trainer) and the share of the step;
the critic's update against the actor's (the cost of running it after the actor's on the same ranks,
rather than beside it on other devices); and the resident MiB of each role in each phase
(`memory/<phase>/<role>_mib`).
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import machine_line  # noqa: E402

from megalign.config import load_config  # noqa: E402
from megalign.data import CharTokenizer  # noqa: E402
from megalign.models import CausalLM, ModelConfig, RewardModel, save_hf_checkpoint  # noqa: E402
from megalign.trainers.ppo import PPOConfig, PPOTrainer  # noqa: E402

PHASES = ("generate", "reward", "reference", "values", "critic_update", "update")
OFFLOAD = ("actor.offload_weights=true", "actor.offload_optimizer=true", "reference.offload_weights=true",
           "reward.model.offload_weights=true", "critic.offload_weights=true", "critic.offload_optimizer=true")


def _models(root: str, hidden: int, layers: int) -> tuple[str, str]:
    tok = CharTokenizer()
    config = ModelConfig(model_type="llama", vocab_size=tok.vocab_size, hidden_size=hidden,
                         intermediate_size=3 * hidden, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=4, head_dim=hidden // 4, max_position_embeddings=128,
                         pad_token_id=tok.pad_id, extra_hf={"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id})
    torch.manual_seed(0)
    paths = []
    for name, cls in (("policy", CausalLM), ("rm", RewardModel)):
        model = cls(config)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, 0.05)
        save_hf_checkpoint(model, os.path.join(root, name))
        paths.append(os.path.join(root, name))
    return paths[0], paths[1]


def _run(policy: str, rm: str, run_dir: str, steps: int, prompts: int, group: int, length: int,
         offload: bool) -> list[dict[str, float]]:
    cfg = load_config(PPOConfig, None, [
        f"run_dir={run_dir}", f"actor.path={policy}", f"critic.path={rm}", f"steps={steps}", "device=cpu",
        "tensorboard=false", "reward.terms=[]", f"reward.model.path={rm}", "algo.kl_coef=0.01",
        f"rollout.prompts_per_step={prompts}", f"rollout.group_size={group}", f"rollout.max_response_length={length}",
        "algo.mini_batches=2", f"algo.micro_batch_size={prompts * group}", "eval.max_samples=0", "save_every=0",
        "export_hf=false", "resume=none", *(OFFLOAD if offload else ())])
    return PPOTrainer(cfg).train().metrics


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="2 rounds of 3 steps instead of 3 rounds of 5")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1, as torchrun's OMP_NUM_THREADS: on a shared, oversubscribed CPU more "
                             "threads spin in OpenMP barriers)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rounds, steps = (2, 3) if args.quick else (3, 5)
    prompts, group, length, hidden, layers = 32, 4, 16, 256, 4
    dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp(prefix='ppo-bench-')}", rank=0,
                            world_size=1, timeout=datetime.timedelta(seconds=600))
    rows: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    with tempfile.TemporaryDirectory() as root:
        policy, rm = _models(root, hidden, layers)
        for r in range(rounds):
            for offload in ((False, True) if r % 2 == 0 else (True, False)):
                metrics = _run(policy, rm, os.path.join(root, f"run{r}{int(offload)}"), steps, prompts, group,
                               length, offload)
                rows[offload].extend(metrics[1:])
    print(f"PPO phases, {prompts} prompts x G={group}, R={length}, Llama {layers} layers hidden {hidden}, "
          f"{rounds} rounds x {steps - 1} timed steps; {machine_line()}")
    print("| phase | resident s | share | offloaded s | share |")
    print("|---|---:|---:|---:|---:|")
    med = {o: {p: statistics.median(m[f"time/{p}"] for m in rows[o]) for p in PHASES + ("step",)} for o in rows}
    for phase in PHASES + ("step",):
        cells = [f"{med[o][phase]:.3f} | {med[o][phase] / med[o]['step']:.1%}" for o in (False, True)]
        print(f"| {phase} | " + " | ".join(cells) + " |")
    for o in (False, True):
        print(f"{'offloaded' if o else 'resident'}: critic update / actor update = "
              f"{med[o]['critic_update'] / med[o]['update']:.2f}x; critic (values + update) = "
              f"{(med[o]['critic_update'] + med[o]['values']) / med[o]['step']:.1%} of the step")
    roles = ("actor", "reference", "reward", "critic")
    print("\n| phase | " + " | ".join(f"{r} MiB (res / off)" for r in roles) + " |")
    print("|---|" + "---:|" * len(roles))
    for phase in PHASES:
        cells = [f"{rows[False][0][f'memory/{phase}/{r}_mib']:.1f} / {rows[True][0][f'memory/{phase}/{r}_mib']:.1f}"
                 for r in roles]
        print(f"| {phase} | " + " | ".join(cells) + " |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
