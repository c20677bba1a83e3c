"""The Run object's state: checked whole, then applied; the rounding generators across devices."""
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
           "stochastic_rounding": {"seed": 3, "generators": {"cpu": torch.zeros(10, dtype=torch.uint8)}}}
    with pytest.raises(ValueError, match=r"stochastic_rounding\['generators'\]\['cpu'\]: not a cpu generator state"):
        ampkit.load_state_dict(bad, optimizer=opt)
    after = ampkit.state_dict(optimizer=opt)
    assert after["loss_scaler0"] == before["loss_scaler0"] and after["stochastic_rounding"]["seed"] == 0
    assert torch.equal(after["stochastic_rounding"]["generators"].get("cpu", torch.empty(0)),
                       before["stochastic_rounding"]["generators"].get("cpu", torch.empty(0)))


def test_a_state_saved_on_another_device_type_loads_by_the_documented_rule():
    model, opt = o7()
    cpu_state = torch.Generator().manual_seed(11).get_state()
    saved = {"loss_scaler0": {"loss_scale": 1.0, "unskipped": 5},
             "stochastic_rounding": {"seed": 9, "generators": {"cuda:0": torch.zeros(16, dtype=torch.uint8), "cpu": cpu_state}}}
    if torch.cuda.is_available():
        pytest.skip("the rule for a device this machine lacks needs a machine without CUDA")
    ampkit.load_state_dict(saved, optimizer=opt)
    state = ampkit.state_dict(optimizer=opt)
    assert state["loss_scaler0"]["unskipped"] == 5 and state["stochastic_rounding"]["seed"] == 9
    assert torch.equal(state["stochastic_rounding"]["generators"]["cpu"], cpu_state)
    assert set(state["stochastic_rounding"]["generators"]) == {"cpu"}


def test_a_cuda_only_state_restarts_the_cpu_generator_from_the_saved_seed():
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    model, opt = o7()
    saved = {"loss_scaler0": {"loss_scale": 1.0, "unskipped": 0},
             "stochastic_rounding": {"seed": 21, "generators": {"cuda:0": torch.zeros(16, dtype=torch.uint8)}}}
    ampkit.load_state_dict(saved, optimizer=opt)
    run = opt._ampkit.run
    assert run.rounding.seed == 21
    fresh = torch.Generator().manual_seed(21).get_state()
    assert torch.equal(run.rounding.generator(torch.device("cpu")).get_state(), fresh)


def test_a_bad_scaler_entry_after_a_good_one_changes_nothing():
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ampkit.initialize(model, opt, opt_level="O2", num_losses=2, verbosity=0)
    with pytest.raises(ValueError, match=r"loss_scaler1\['loss_scale'\]"):
        ampkit.load_state_dict({"loss_scaler0": {"loss_scale": 8.0, "unskipped": 0},
                                "loss_scaler1": {"loss_scale": -1.0, "unskipped": 0}}, optimizer=opt)
    assert [s.loss_scale() for s in ampkit.loss_scalers(opt)] == [2.0**16, 2.0**16]
