"""O5's masters update (``ampkit/_update/masters.py``), and the chunked updates of O7, O8 and the
remainder masters (``_update/chunks.py``): the fp32 parameters the optimizer holds itself (norms
kept in fp32) step in the fused masters' op beside the fused parameters, bit for bit the eager
reference and torch's step within a float32 rounding (O7, O8: within their bf16 weights' rounding); O2's
float16 masters and a group the kernels do not take leave them to the optimizer's own step."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampkit
from ampkit._kernels import native
from ampkit._update import fused_sgd_update, fused_update
from tests.update.test_fused_update import same, snapshot

OPTIMIZERS = {
    "sgd": lambda groups: torch.optim.SGD(groups, lr=0.05, momentum=0.9, weight_decay=0.01),
    "adamw": lambda groups: torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1),
}
LEVELS = {"O5": ("O5", {}), "O7": ("O7", {}), "O8": ("O8", {}), "remainder": ("O5", {"master_weights": "remainder"})}
STEP_MASTERS = {"sgd": (fused_sgd_update, fused_sgd_update.step_masters), "adamw": (fused_update, fused_update.step_masters)}


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 12), nn.BatchNorm1d(12), nn.Tanh(), nn.Linear(12, 3))


def _train(level, kind, path, monkeypatch, steps=4, split=False):
    """(model, optimizer, own steps, fp32 parameters per fused step) after ``steps`` steps, the
    second skipped (an infinite loss), on ``path``: the kernel, the eager reference, or torch's step.
    ``split``: the BatchNorm in a group of its own that the AdamW kernels do not take (amsgrad)."""
    monkeypatch.setattr(native, "_state", {"lib": None} if path == "eager" else {})
    monkeypatch.setenv("AMPKIT_FUSED", "0" if path == "torch" else "1")
    model = _model()
    groups = ([{"params": [p for n, p in model.named_parameters() if not n.startswith("1.")]},
               {"params": list(model[1].parameters()), "amsgrad": True}] if split else model.parameters())
    level, kw = LEVELS.get(level, (level, {}))
    model, opt = ampkit.initialize(model, OPTIMIZERS[kind](groups), opt_level=level, verbosity=0, **kw)
    own, fp32 = [], []
    real_own = opt._ampkit.update.own_step
    monkeypatch.setattr(opt._ampkit.update, "own_step", lambda: (own.append(1), real_own())[1])
    module, real = STEP_MASTERS[kind]
    monkeypatch.setattr(module, "step_masters",
                        lambda o, items: (fp32.append(sum(p is None for _, _, p in items)), real(o, items))[1])
    g = torch.Generator().manual_seed(1)
    for k in range(steps):
        x, y = torch.randn(16, 5, generator=g), torch.randn(16, 3, generator=g)
        opt.zero_grad()
        loss = F.mse_loss(model(x).float(), y) * (float("inf") if k == 1 else 1.0)
        with ampkit.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
    return model, opt, len(own), fp32


@pytest.mark.parametrize("level", list(LEVELS))
@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_fp32_parameters_step_in_the_fused_op(lib, monkeypatch, kind, level):
    runs = {path: _train(level, kind, path, monkeypatch) for path in ("kernel", "eager", "torch")}
    for path in ("kernel", "eager"):
        model, opt, own, fp32 = runs[path]
        assert own == 0 and fp32 == [2, 2, 2]  # BatchNorm's weight and bias, every unskipped step
        assert model[1].weight.dtype == torch.float32 and model[0].weight.dtype == torch.bfloat16
        assert opt.state[model[1].weight].keys() == runs["torch"][1].state[runs["torch"][0][1].weight].keys()
    assert runs["torch"][2] == 3 and runs["torch"][3] == []
    kernel, torch_run = snapshot(*runs["kernel"][:2]), snapshot(*runs["torch"][:2])
    assert same(kernel, snapshot(*runs["eager"][:2]))
    assert not same(kernel, snapshot(_model(), torch.optim.SGD(_model().parameters(), lr=0.1)))
    tol = dict(rtol=8e-3, atol=1e-5) if level in ("O7", "O8") else dict(rtol=2e-6, atol=1e-7)
    for a, b in zip(kernel[0], torch_run[0]):
        torch.testing.assert_close(a.float(), b.float(), **tol)


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_o2s_fp32_parameters_take_the_optimizers_own_step(lib, monkeypatch, kind):
    """O2's masters are of float16 parameters (torch's step): its fp32 ones stay with them."""
    model, opt, own, fp32 = _train("O2", kind, "kernel", monkeypatch)
    assert own == 3 and fp32 == []
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_group_the_kernels_do_not_take_steps_in_the_optimizers_own_step(lib, monkeypatch):
    """An amsgrad group (the BatchNorm) takes torch's step; the masters' group the fused op's,
    and the result is torch's within a float32 rounding."""
    kernel = _train("O5", "adamw", "kernel", monkeypatch, split=True)
    torch_run = _train("O5", "adamw", "torch", monkeypatch, split=True)
    assert kernel[2] == 3 and kernel[3] == [0, 0, 0]
    assert "max_exp_avg_sq" in kernel[1].state[kernel[0][1].weight]
    for a, b in zip(kernel[0].parameters(), torch_run[0].parameters()):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_an_o8_step_whose_fp32_parameter_would_turn_non_finite_is_skipped_whole(lib, monkeypatch, kind):
    """O8 steps its bf16 parameters in its kernel, then the BatchNorm in the fused masters' op;
    a learning rate past float32's range turns the BatchNorm non-finite: the step is skipped and
    every weight and state tensor is as before."""
    from tests.update.test_state_8bit import raw_state
    model = _model()
    opt = OPTIMIZERS[kind]([{"params": [p for n, p in model.named_parameters() if not n.startswith("1.")]},
                            {"params": list(model[1].parameters())}])
    model, opt = ampkit.initialize(model, opt, opt_level="O8", verbosity=0)
    module, real = STEP_MASTERS[kind]
    fp32 = []
    monkeypatch.setattr(module, "step_masters",
                        lambda o, items: (fp32.append(sum(p is None for _, _, p in items)), real(o, items))[1])
    x, y = torch.randn(16, 5, generator=torch.Generator().manual_seed(1)), torch.zeros(16, 3)

    def step():
        opt.zero_grad()
        with ampkit.scale_loss(F.mse_loss(model(x).float(), y), opt) as scaled:
            scaled.backward()
        opt.step()
    step()
    weights, state = [p.detach().clone() for p in model.parameters()], raw_state(opt)
    opt.param_groups[1]["lr"] = 1e39
    step()
    assert ampkit.step_was_skipped(opt) and fp32 == [2, 2]
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))
    after = raw_state(opt)
    assert after.keys() == state.keys() and all(torch.equal(state[k], after[k]) for k in state)
    opt.param_groups[1]["lr"] = 1e-3
    step()
    assert not ampkit.step_was_skipped(opt) and not torch.equal(weights[2], model[1].weight)
