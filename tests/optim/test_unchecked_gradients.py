"""Gradients no ``scale_loss`` checked (``loss.backward()`` called directly, as framework loops
do): ``step()`` checks them in one pass and skips the step on inf/NaN, at every level."""
import logging

import pytest
import torch
from torch import nn

import ampkit

LEVELS = ["O0", "O1", "O2", "O3", "O4", "O5", "O6", "O7", "O8", "remainder"]


def build(level):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Linear(16, 1))
    if level == "O3":  # AdamW's eps is 0 in float16 weights without masters
        opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    kw = {"opt_level": "O5", "master_weights": "remainder"} if level == "remainder" else {"opt_level": level}
    return ampkit.initialize(model, opt, verbosity=1, **kw)


def raw_step(model, opt, poison=None):
    """One step whose backward runs outside scale_loss; ``poison`` multiplies the last layer's
    weight gradient."""
    opt.zero_grad()
    handle = model[2].weight.register_hook(lambda g: g * poison) if poison is not None else None
    x = torch.randn(8, 16, dtype=next(model.parameters()).dtype)
    model(x).float().pow(2).mean().backward()
    if handle is not None:
        handle.remove()
    opt.step()


def snapshot(model, opt):
    weights = [p.detach().clone() for p in model.parameters()]
    state = {id(p): {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()} for p, s in opt.state.items()}
    return weights, state


def same(a, b) -> bool:
    (wa, sa), (wb, sb) = a, b
    if not all(torch.equal(x, y) for x, y in zip(wa, wb)) or sa.keys() != sb.keys():
        return False
    return all(sa[k].keys() == sb[k].keys() and all(torch.equal(torch.as_tensor(sa[k][n]), torch.as_tensor(sb[k][n]))
                                                    for n in sa[k]) for k in sa)


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
@pytest.mark.parametrize("level", LEVELS)
def test_a_nonfinite_gradient_from_a_plain_backward_never_reaches_the_weights(level, poison, caplog):
    if level == "O6":
        pytest.importorskip("torchao")
    model, opt = build(level)
    raw_step(model, opt)  # a clean step first: the optimizer has state to keep
    assert not ampkit.step_was_skipped(opt)
    before, skipped = snapshot(model, opt), ampkit.loss_scalers(opt)[0].skipped_steps
    scale = ampkit.loss_scalers(opt)[0].loss_scale()
    with caplog.at_level(logging.INFO, logger="ampkit"):
        raw_step(model, opt, poison)
    assert ampkit.step_was_skipped(opt)
    assert same(snapshot(model, opt), before)  # weights and optimizer state untouched
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert ampkit.nonfinite_gradients(opt) == ["2.weight"]
    assert any("outside scale_loss" in r.getMessage() for r in caplog.records)
    scaler = ampkit.loss_scalers(opt)[0]
    assert scaler.skipped_steps == skipped + 1 and scaler.loss_scale() == scale  # counted; the scale stays
    raw_step(model, opt)  # training goes on
    assert not ampkit.step_was_skipped(opt) and ampkit.nonfinite_gradients(opt) == []
    assert not same(snapshot(model, opt), before)


@pytest.mark.parametrize("level", ["O0", "O2", "O7"])
def test_the_extra_pass_runs_only_on_gradients_no_scale_loss_checked(level, monkeypatch):
    from ampkit._optim import optimizer_state
    model, opt = build(level)
    passes, real = [], optimizer_state.unscale_and_check_
    monkeypatch.setattr(optimizer_state, "unscale_and_check_", lambda *a: passes.append(1) or real(*a))
    opt.zero_grad()
    with ampkit.scale_loss(model(torch.randn(8, 16, dtype=next(model.parameters()).dtype)).float().mean(), opt) as s:
        s.backward()
    passes.clear()  # the unscale's own
    opt.step()
    assert passes == []
    raw_step(model, opt)
    assert passes == [1]
