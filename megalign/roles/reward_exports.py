"""What a reward-model export carries beside its HF weights, written and read in one place.

- `prm.json` (`PRM_FILE`): a process (or outcome) reward model of `megalign.trainers.prm` names its two
  reward tokens (text and id), the step separator and its supervision, so every reader (the `process`
  reward role, best-of-N reranking) scores steps as it was trained, without guessing.
- `reward_stats.json` (`REWARD_STATS_FILE`): a Bradley-Terry reward model of `megalign.trainers.preference`
  records the mean and std of its rewards over the held-out responses, so a later stage (PPO's
  `algo.reward_normalize`) can normalise its scores, as OpenRLHF stores them with its reward models.
  A run without held-out pairs takes them over its training responses instead (which the model has fit,
  so their spread can be wider than on new text); `source` ("held_out" or "train") and the count
  `<source>_responses` say which. Files written before `source` existed are held-out statistics.
  Beside them, `platt_a` and `platt_b`: Platt scaling of the score over the same responses, chosen labelled 1 and
  rejected 0 (`megalign.algos.platt_fit`), so PPO's `algo.reward_calibrate` can read the score as the probability
  sigmoid(a * s + b) that a response is on the chosen side; with pairs labelled by a verifier (right vs wrong)
  that is a pass probability.

Both files are written by rank 0 through a temporary name and a rename (`atomic_write_text`).
"""
from __future__ import annotations

import json
import logging
import os
from typing import Optional

from megalign.config import atomic_write_text

logger = logging.getLogger(__name__)

PRM_FILE = "prm.json"
REWARD_STATS_FILE = "reward_stats.json"


def write_prm_info(path: str, token_ids: tuple[int, int], tokens: tuple[str, str], separator: str,
                   supervise: str) -> None:
    """`prm.json` in the export folder `path`: (negative, positive) reward token ids and texts, separator, supervision."""
    info = {"negative_token_id": token_ids[0], "positive_token_id": token_ids[1], "negative_token": tokens[0],
            "positive_token": tokens[1], "separator": separator, "supervise": supervise}
    atomic_write_text(os.path.join(path, PRM_FILE), json.dumps(info, indent=1))


def load_prm_info(path: str) -> dict:
    """The `prm.json` of an exported PRM / ORM folder (`write_prm_info`); a clear error when it is missing."""
    file = os.path.join(path, PRM_FILE)
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{file} not found: {path} is not a PRM export of launch/train_prm.py")
    with open(file) as f:
        return json.load(f)


REWARD_STATS_SOURCES = ("held_out", "train")
"""Which responses `reward_stats.json` was computed over (module doc)."""


def write_reward_stats(path: str, reward_sum: float, reward_sq_sum: float, responses: int,
                       source: str = "held_out", platt: Optional[tuple[float, float]] = None) -> None:
    """`reward_stats.json` in the export folder `path` from the sum and sum of squares of the rewards of
    `responses` responses of `source` (`REWARD_STATS_SOURCES`): mean = sum / n, std = sqrt(max(sum_sq / n - mean^2,
    0)) (population std), and the Platt scaling (a, b) of the same responses when given; logged with where the
    numbers come from."""
    if source not in REWARD_STATS_SOURCES:
        raise ValueError(f"source must be one of {REWARD_STATS_SOURCES}, got {source!r}")
    n = max(responses, 1)
    mean = reward_sum / n
    stats = {"reward_mean": mean, "reward_std": max(reward_sq_sum / n - mean ** 2, 0.0) ** 0.5,
             f"{source}_responses": int(responses), "source": source}
    if platt is not None:
        stats["platt_a"], stats["platt_b"] = float(platt[0]), float(platt[1])
    file = os.path.join(path, REWARD_STATS_FILE)
    atomic_write_text(file, json.dumps(stats, indent=1))
    what = "held-out responses" if source == "held_out" else "training responses (no held-out pairs were scored)"
    logger.info("%s: reward mean %.6g, std %.6g over %d %s", file, stats["reward_mean"], stats["reward_std"],
                responses, what)


def _read_stats(path: str, needed_by: str) -> tuple[str, dict]:
    """(file, contents) of the export's `reward_stats.json`, read for the option `needed_by`; a clear error naming
    the file and the option when it is missing."""
    file = os.path.join(path, REWARD_STATS_FILE)
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{needed_by} needs {file} (written by the RM trainer's export); train the RM with "
                                f"megalign or turn {needed_by} off")
    with open(file) as f:
        return file, json.load(f)


def reward_stats(path: str, needed_by: str = "algo.reward_normalize=true") -> tuple[float, float]:
    """(mean, std) from a reward-model export's `reward_stats.json` (`write_reward_stats`) for the option
    `needed_by`; a clear error when it is missing or its std is not positive (normalising by it would divide by
    zero)."""
    file, stats = _read_stats(path, needed_by)
    if not stats.get("reward_std", 0) > 0:
        raise ValueError(f"{file}: reward_std must be > 0, got {stats.get('reward_std')!r}")
    return float(stats["reward_mean"]), float(stats["reward_std"])


def reward_calibration(path: str) -> tuple[float, float]:
    """Platt's (a, b) from a reward-model export's `reward_stats.json` (`write_reward_stats`): the reward
    sigmoid(a * s + b) of PPO's `algo.reward_calibrate`; a clear error when the file or the fit is missing."""
    file, stats = _read_stats(path, "algo.reward_calibrate=true")
    if "platt_a" not in stats or "platt_b" not in stats:
        raise ValueError(f"{file} has no Platt scaling (platt_a, platt_b): it was exported before megalign fitted "
                         f"one, or from pairs of one side only; re-export the RM or set algo.reward_calibrate=false")
    return float(stats["platt_a"]), float(stats["platt_b"])
