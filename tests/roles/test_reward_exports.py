"""The files beside a reward-model export (`megalign.roles.reward_exports`): what is written is what is read, the
reward statistics are the population mean and std worked by hand, and a missing or unusable file is refused with a
message naming it."""
import json
import math

import pytest

from megalign.roles.reward_exports import (load_prm_info, reward_calibration, reward_stats, write_prm_info,
                                          write_reward_stats)


def test_reward_stats_are_the_population_mean_and_std(tmp_path):
    # rewards 1, 2, 3, 4: sum 10, sum of squares 30 -> mean 2.5, variance 30 / 4 - 2.5^2 = 1.25
    write_reward_stats(str(tmp_path), 10.0, 30.0, 4)
    with open(tmp_path / "reward_stats.json") as f:
        assert json.load(f) == {"reward_mean": 2.5, "reward_std": math.sqrt(1.25), "held_out_responses": 4,
                                  "source": "held_out"}
    assert reward_stats(str(tmp_path)) == (2.5, math.sqrt(1.25))
    assert not [p.name for p in tmp_path.iterdir() if p.name != "reward_stats.json"]  # no temporary left behind


def test_reward_stats_refuse_a_missing_file_or_a_zero_std(tmp_path):
    with pytest.raises(FileNotFoundError, match="reward_normalize=true needs .*reward_stats.json"):
        reward_stats(str(tmp_path))
    write_reward_stats(str(tmp_path), 6.0, 12.0, 3)  # three rewards of 2: std 0, normalising would divide by it
    with pytest.raises(ValueError, match="reward_std must be > 0, got 0.0"):
        reward_stats(str(tmp_path))


def test_platt_scaling_is_read_as_written_and_its_absence_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="reward_calibrate=true needs .*reward_stats.json"):
        reward_calibration(str(tmp_path))
    write_reward_stats(str(tmp_path), 10.0, 30.0, 4)  # an export without a fit (older, or one-sided)
    with pytest.raises(ValueError, match="has no Platt scaling"):
        reward_calibration(str(tmp_path))
    write_reward_stats(str(tmp_path), 10.0, 30.0, 4, platt=(1.25, -0.5))
    assert reward_calibration(str(tmp_path)) == (1.25, -0.5)
    assert reward_stats(str(tmp_path)) == (2.5, math.sqrt(1.25))


def test_prm_info_is_read_as_written(tmp_path):
    write_prm_info(str(tmp_path), (7, 9), ("-", "+"), "\n", "outcome")
    assert load_prm_info(str(tmp_path)) == {"negative_token_id": 7, "positive_token_id": 9, "negative_token": "-",
                                            "positive_token": "+", "separator": "\n", "supervise": "outcome"}


def test_load_prm_info_names_the_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="prm.json not found"):
        load_prm_info(str(tmp_path))
