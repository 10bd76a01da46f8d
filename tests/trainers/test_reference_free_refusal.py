"""A reference setting under a reference-free loss is refused when the config loads (issue 32 item 10).

SimPO, CPO and ORPO build no reference model, so `reference.mode=online` or `reference.path=...` was ignored without
a word, for the offline DPO trainer and for online DPO alike. Now the config names the key and the loss.
"""
import pytest

from megalign.config import ConfigError, load_config
from megalign.trainers.online_dpo import OnlineDPOConfig
from megalign.trainers.preference import DPOConfig


@pytest.mark.parametrize("cls", [DPOConfig, OnlineDPOConfig])
@pytest.mark.parametrize("loss", ["simpo", "cpo", "orpo"])
def test_a_changed_reference_key_is_refused_naming_key_and_loss(cls, loss):
    with pytest.raises(ConfigError, match=rf"reference.path='/models/ref' is set but algo.loss='{loss}' uses no "
                                          r"reference model"):
        load_config(cls, None, [f"algo.loss={loss}", "reference.path=/models/ref"])


def test_every_changed_key_is_named():
    with pytest.raises(ConfigError, match=r"reference.tp=2, reference.mode='online' are set but algo.loss='simpo'"):
        load_config(DPOConfig, None, ["algo.loss=simpo", "reference.mode=online", "reference.tp=2"])
    with pytest.raises(ConfigError, match=r"reference.dtype='bf16', reference.offload_weights=True are set but "
                                          r"algo.loss='orpo'"):
        load_config(OnlineDPOConfig, None, ["algo.loss=orpo", "reference.dtype=bf16", "reference.offload_weights=true"])


@pytest.mark.parametrize("cls", [DPOConfig, OnlineDPOConfig])
def test_defaults_or_a_loss_with_a_reference_are_accepted(cls):
    assert not load_config(cls, None, ["algo.loss=simpo"]).algo.uses_reference
    assert load_config(cls, None, ["algo.loss=sigmoid", "reference.path=/models/ref"]).reference.path == "/models/ref"
    # a key written with its default value changes nothing, so it is no reason to refuse
    assert load_config(cls, None, ["algo.loss=cpo", "reference.tp=1"]).reference.tp == 1
