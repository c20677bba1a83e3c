"""ampkit.nonfinite_gradients(): the layers behind a skipped step, looked for only on an overflow."""
import logging

import pytest
import torch
from torch import nn

import ampkit
from ampkit._run import health, overflow


def build(level):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return ampkit.initialize(model, opt, opt_level=level, verbosity=0)


def step(model, opt):
    opt.zero_grad()
    with ampkit.scale_loss(model(torch.randn(16, 4)).float().pow(2).mean(), opt) as scaled:
        scaled.backward()
    opt.step()


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O5", "O7"])
def test_names_exactly_the_parameters_whose_gradients_overflowed(level):
    model, opt = build(level)
    step(model, opt)
    assert ampkit.nonfinite_gradients(opt) == [] and not ampkit.step_was_skipped(opt)
    handle = model[2].weight.register_hook(lambda g: g * float("inf"))
    step(model, opt)
    assert ampkit.step_was_skipped(opt)
    assert ampkit.nonfinite_gradients(opt) == ["2.weight"] == ampkit.nonfinite_gradients()
    handle.remove()
    step(model, opt)
    assert ampkit.nonfinite_gradients(opt) == [] and not ampkit.step_was_skipped(opt)


def test_a_clean_step_does_not_look(monkeypatch):
    model, opt = build("O2")
    calls = []
    real = overflow.nonfinite_names
    monkeypatch.setattr(overflow, "nonfinite_names", lambda *a: calls.append(1) or real(*a))
    for _ in range(3):
        step(model, opt)
    assert calls == []
    model[0].bias.register_hook(lambda g: g * float("nan"))
    step(model, opt)
    assert calls == [1] and ampkit.nonfinite_gradients(opt) == ["0.bias"]


def test_the_consecutive_skips_warning_names_them(caplog, monkeypatch):
    monkeypatch.setattr(health, "CONSECUTIVE_SKIPS", 3)
    model, opt = build("O2")
    model[4].weight.register_hook(lambda g: g * float("inf"))
    with caplog.at_level(logging.WARNING, logger="ampkit"):
        for _ in range(3):
            step(model, opt)
    warned = [r.getMessage() for r in caplog.records if "skipped 3 steps in a row" in r.getMessage()]
    assert len(warned) == 1 and "Non-finite gradients in this step: 4.weight" in warned[0]
    assert "ampkit.precision_report(" in warned[0]


def test_several_models_are_prefixed_and_a_wrong_kind_is_named():
    torch.manual_seed(0)
    a, b = nn.Linear(4, 4), nn.Linear(4, 1)
    opt = torch.optim.SGD(list(a.parameters()) + list(b.parameters()), lr=0.1)
    (a, b), opt = ampkit.initialize([a, b], opt, opt_level="O5", verbosity=0)  # bf16: nothing else overflows
    b.bias.register_hook(lambda g: g * float("inf"))
    opt.zero_grad()
    with ampkit.scale_loss(b(a(torch.randn(3, 4))).float().sum(), opt) as scaled:
        scaled.backward()
    opt.step()
    assert ampkit.nonfinite_gradients(opt) == ["models[1].bias"]
    with pytest.raises(TypeError, match=r"nonfinite_gradients\(\): optimizer= expects an optimizer"):
        ampkit.nonfinite_gradients(a)
