"""Training checkpoints (torch.distributed.checkpoint, written atomically), resume, NaN guard, HF export.

`CheckpointManager(run_dir, keep_last)` saves `{"model": ModelState(model, layout), "optim":
OptimizerState(model, optimizer, layout), "rng": RNGState(), "sampler": sampler, ...}` at a step and
loads it back in place; `resolve_resume("auto")` finds the latest complete one. A checkpoint holds
the config it was written with and the fingerprints of the run's data files, and `check_resume_config` /
`check_resume_data` refuse (or, allowed, warn about) a resume whose config or data files differ;
`write_run_config` writes the run's `config.yaml`, keeping earlier ones.
`export_hf` writes the final model for `transformers` and the next stage; `RunDirLock` keeps a second
job out of a run directory in use. (The trainers' skip-the-step check, `all_finite`, is a collective
and lives in `megalign.parallel`.)
"""
from megalign.checkpoint.data_files import check_resume_data, data_file_changes, fingerprint_files
from megalign.checkpoint.hf_export import export_hf
from megalign.checkpoint.lock import RunDirLock, RunDirLocked
from megalign.checkpoint.manager import CheckpointManager, checkpoint_step
from megalign.checkpoint.resume import check_resume_config, config_changes, with_defaults, write_run_config
from megalign.checkpoint.state import (
    Counters,
    ModelState,
    OptimizerState,
    RNGState,
    capture_rng_state,
    nonfinite_keys,
    restore_rng_state,
)

__all__ = [
    "CheckpointManager", "checkpoint_step", "Counters", "ModelState", "OptimizerState", "RNGState",
    "capture_rng_state", "restore_rng_state", "nonfinite_keys", "export_hf",
    "check_resume_config", "config_changes", "with_defaults", "write_run_config", "RunDirLock", "RunDirLocked",
    "fingerprint_files", "data_file_changes", "check_resume_data",
]
