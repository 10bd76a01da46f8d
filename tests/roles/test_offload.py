"""Offload of role parts: storage leaves and comes back exactly, objects keep their identity, nothing else moves."""
import pytest
import torch
from torch import nn

from megalign.roles.base import ModelRole, Role, optimizer_slots


class _Trainable(ModelRole):
    def __init__(self, model, optimizer, offload_optimizer):
        super().__init__("trainable", model, None, offload_weights=False, extra_switches={"optimizer": offload_optimizer})
        self.optimizer = optimizer

    def parts(self):
        return {**super().parts(), "optimizer": optimizer_slots(self.optimizer)}


def test_weights_round_trip():
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    weight, before = model.weight, {k: v.clone() for k, v in model.state_dict().items()}
    role = ModelRole("policy", model, None, offload_weights=True)
    assert role.resident_bytes() == (3 * 2 + 2) * 4
    role.need()
    assert role.resident_bytes() == 0 and model.weight.numel() == 0  # using it now would fail loudly
    role.need()  # already offloaded: nothing happens
    role.need("weights")
    assert model.weight is weight  # same Parameter: optimizers and hooks keep working
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert role.resident_bytes() == (3 * 2 + 2) * 4


def test_optimizer_state_round_trip_and_switches():
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    state = {k: v.clone() for k, v in optimizer.state[model.weight].items()}
    role = _Trainable(model, optimizer, offload_optimizer=True)
    role.need("weights")
    assert optimizer.state[model.weight]["exp_avg"].numel() == 0
    assert model.weight.numel() == 16  # weights have no offload switch on: they stay
    role.need("weights", "optimizer")
    assert all(torch.equal(state[k], v) for k, v in optimizer.state[model.weight].items())


def test_unknown_part_is_named():
    with pytest.raises(ValueError, match=r"role 'reward' has no part \['weights'\]"):
        Role("reward", None, {}).need("weights")
