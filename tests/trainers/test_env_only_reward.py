"""An online run whose whole reward is the environment's (issue 28: the simulated user's e_T / 100): `reward.terms`
may be empty only with multi-turn episodes that do not score their final turn; everywhere else an empty reward is
refused at config load, naming the section."""
import os

import pytest

from megalign.config import ConfigError, load_config
from megalign.trainers.grpo import GRPOConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
USER_SIM = os.path.join(ROOT, "examples", "grpo_user_sim.yaml")


def test_the_user_sim_example_has_no_reward_term_and_loads():
    cfg = load_config(GRPOConfig, USER_SIM)
    assert cfg.reward.empty() and cfg.rollout.env.score_final_turn is False


@pytest.mark.parametrize("overrides", [["rollout.env=null"], ["rollout.env.score_final_turn=true"]])
def test_an_empty_reward_is_refused_where_nothing_else_rewards(overrides):
    with pytest.raises(ConfigError, match=r"reward: the reward needs at least one term, reward model or judge"):
        load_config(GRPOConfig, USER_SIM, overrides)


def test_the_default_reward_is_not_empty():
    assert not load_config(GRPOConfig, None, []).reward.empty()
