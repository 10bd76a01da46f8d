"""Data and evaluation tools that use the trainers (run by `launch/prm_tools.py` and `launch/sample_pairs.py`).

- `best_of_n`: process supervision from a policy's own samples: the chains' SFT rows, Monte-Carlo
  step labels for the PRM (`label_steps`), and held-out best-of-N reranked by the PRM and the ORM.
- `self_pairs`: preference pairs from a policy's own samples, labelled by a verifier (the RM data of
  `launch/run_embedded.sh ppo`).
- `cai`: Constitutional AI / RLAIF (`launch/cai_tools.py`): AI preference labels from a judge model (`label`)
  and, in `cai_revise`, critique-revise SFT rows (`critique_revise`); both resumable and multi-process.
- `moe_run`: the embedded MoE run's from-scratch Qwen3-MoE folder and its before / after and mismatch table
  (`launch/moe_run.py`, `launch/run_embedded.sh moe`).

Submodules are imported directly (`from megalign.tools.best_of_n import best_of_n`).
"""
