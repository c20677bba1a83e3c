"""The Run object's state: checked whole, then applied; older rounding states with generators."""
import logging

import pytest
import torch
from torch import nn

import ampkit


def o7(seed=0):
    torch.manual_seed(seed)
    model = nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return ampkit.initialize(model, opt, opt_level="O7", verbosity=0)


def test_a_malformed_generator_state_changes_nothing():
    model, opt = o7()
    before = ampkit.state_dict(optimizer=opt)
    bad = {"loss_scaler0": {"loss_scale": 4.0, "unskipped": 1},
           "stochastic_rounding": {"seed": 3, "step": 2, "generators": {"cpu": torch.zeros(10)}}}
    with pytest.raises(ValueError, match=r"stochastic_rounding\['generators'\]\['cpu'\]: expected a generator state"):
        ampkit.load_state_dict(bad, optimizer=opt)
    assert ampkit.state_dict(optimizer=opt) == before and before["stochastic_rounding"] == {"seed": 0, "step": 0}


def test_an_old_state_with_generators_of_any_device_loads_seed_and_step():
    """Generator states (any device, this machine's or not) are ignored: the seed and step are the state."""
    model, opt = o7()
    saved = {"loss_scaler0": {"loss_scale": 1.0, "unskipped": 5},
             "stochastic_rounding": {"seed": 9, "step": 4, "generators": {"cuda:0": torch.zeros(16, dtype=torch.uint8),
                                                                         "cpu": torch.Generator().manual_seed(11).get_state()}}}
    ampkit.load_state_dict(saved, optimizer=opt)
    state = ampkit.state_dict(optimizer=opt)
    assert state["loss_scaler0"]["unskipped"] == 5 and state["stochastic_rounding"] == {"seed": 9, "step": 4}


def test_a_bad_scaler_entry_after_a_good_one_changes_nothing():
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ampkit.initialize(model, opt, opt_level="O2", num_losses=2, verbosity=0)
    with pytest.raises(ValueError, match=r"loss_scaler1\['loss_scale'\]"):
        ampkit.load_state_dict({"loss_scaler0": {"loss_scale": 8.0, "unskipped": 0},
                                "loss_scaler1": {"loss_scale": -1.0, "unskipped": 0}}, optimizer=opt)
    assert [s.loss_scale() for s in ampkit.loss_scalers(opt)] == [2.0**16, 2.0**16]
