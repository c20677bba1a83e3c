"""ampkit next to what users already have: torch.amp.GradScaler, logging, packaging."""
import subprocess
import sys

import pytest
import torch
from torch import nn

import ampkit


def _model_and_opt(level):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return ampkit.initialize(model, opt, opt_level=level, verbosity=0)


@pytest.mark.parametrize("level", ["O2", "O5"])
def test_grad_scaler_on_a_master_weight_optimizer_is_a_clear_error(level):
    model, opt = _model_and_opt(level)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    scaler.scale(model(torch.randn(3, 4)).float().pow(2).mean()).backward()
    weights = [p.detach().clone() for p in model.parameters()]
    masters = [p.detach().clone() for g in opt.param_groups for p in g["params"]]
    with pytest.raises(RuntimeError, match=r"GradScaler.*ampkit\.scale_loss.*ampkit\.load_state_dict"):
        scaler.step(opt)
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(masters, (p for g in opt.param_groups for p in g["params"])))
    assert opt.state_dict()["state"] == {}


def test_grad_scaler_checkpoint_scale_carries_into_ampkit():
    scaler = torch.amp.GradScaler("cpu", init_scale=4096.0)
    model, opt = _model_and_opt("O2")
    ampkit.load_state_dict({"loss_scaler0": {"loss_scale": scaler.get_scale(), "unskipped": 0}})
    assert ampkit.state_dict()["loss_scaler0"]["loss_scale"] == 4096.0
    loss = model(torch.randn(3, 4)).float().pow(2).mean()
    with ampkit.scale_loss(loss, opt) as scaled:
        assert scaled.item() == pytest.approx(loss.item() * 4096.0, rel=1e-6)
        scaled.backward()
    opt.step()


def test_grad_scaler_without_masters_still_works_as_in_torch():
    """O1 keeps fp32 weights: GradScaler drives the optimizer exactly as on a plain one."""
    torch.manual_seed(0)
    ref = nn.Linear(4, 2)
    model = nn.Linear(4, 2)
    model.load_state_dict(ref.state_dict())
    x = torch.randn(3, 4)
    results = []
    for m, wrap in ((ref, False), (model, True)):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        if wrap:
            m, opt = ampkit.initialize(m, opt, opt_level="O1", half_dtype=torch.bfloat16, verbosity=0)
        scaler = torch.amp.GradScaler("cpu", init_scale=64.0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = m(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        results.append(m.weight.detach().clone())
    assert torch.equal(results[0], results[1])


def test_help_and_version_do_not_import_torch():
    code = ("import sys, runpy; sys.argv = ['ampkit', '--version']\n"
            "try:\n    runpy.run_module('ampkit', run_name='__main__')\n"
            "except SystemExit as e:\n    assert e.code == 0\n"
            "print('torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [f"ampkit {ampkit.__version__}", "False"]
