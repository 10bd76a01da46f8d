"""Training loops on one skeleton, and what they share.

- `base`: the one lifecycle (`Trainer`: start-up, seeding, checkpoint-state registry, loop with save /
  eval cadence, skipped-update counting, export, closing table), on `run_config` (the shared
  `RunConfig` and `DataConfig`), `run_dir` (the start-up checks: the resume, checkpoints the run does
  not continue, room for a checkpoint), `model_checks`, `outcome` (`TrainResult`,
  the update counts, a run that never trained) and `metric_sums` (`MetricSums`: named metric
  reduction over ranks); the names trainers import stay importable from `base`.
- `supervised`: the supervised family, one trainer with an objective plugged in (`Objective`);
  `sft`, `preference` (DPO family, reward model), `kto` and `prm` (process reward model;
  `megalign.tools.best_of_n` makes its Monte-Carlo labels and measures it by reranking) are objectives on it.
- `online`: the online (RL) family: colocated actor / reference / reward roles, rollouts
  (`RolloutBatch`), scoring; `grpo` is GRPO and its DAPO / Dr. GRPO variants on it; `online_dpo` is
  online DPO (pairs of the actor's own samples ranked by the reward, the offline DPO loss).
- `evaluation` (held-out greedy generation scored by a reward function), `optim` (AdamW with ZeRO-1,
  LR schedule), `logging` (MetricsLogger, PhaseTimer, memory_report), `watchdog` (a rank with no
  phase edge for `watchdog_minutes` ends the job naming the phase), `stopping` (stop signals, timed
  saves), `cli` (argv, `--help`, one-line config / data / model / run errors, process group).

Checkpoints live in `megalign.checkpoint`. Submodules are imported directly (`from megalign.trainers.sft
import train_sft`) so that importing one trainer does not import the others.
"""
