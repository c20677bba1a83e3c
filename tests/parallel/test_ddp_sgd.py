"""Fused SGD with momentum under DDP on 2 gloo ranks (O5's masters, O7 with float32 and bf16
buffers; the fp32 BatchNorm parameters in the fused masters' op at each) against one process over
the same batches: the ranks hold bit-identical weights and buffers, which match one process up to
the gradients' summation order, and the fused step ran."""
import pytest
import torch
from torch import nn

import ampkit
from ampkit.parallel import DistributedDataParallel

from ._launch import run
from ._models import micro_batches, train_steps

LEVELS = {"O5": {}, "O7": {}, "O7/bf16_state": {"optimizer_state_dtype": torch.bfloat16}}
STEPS = 4
HALF_CLOSE = dict(rtol=2e-2, atol=2e-2)  # bf16 weights and bf16 gradients: an ulp of bf16 on values of order 1


def _build(name):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 3)).eval()  # running stats:
    net[1].running_mean.uniform_(-0.5, 0.5)  # the same normalization on every rank and in one process
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)
    return ampkit.initialize(net, opt, opt_level=name.split("/")[0], verbosity=0, **LEVELS[name])


def _train(name, data, ddp_wrap=False):
    from ampkit._update import fused_sgd_update
    calls, fp32, real = [], [], (fused_sgd_update.step_masters, fused_sgd_update.step)
    fused_sgd_update.step_masters = lambda o, items: (calls.append(1), fp32.append(sum(p is None for *_, p in items)),
                                                      real[0](o, items))[2]
    fused_sgd_update.step = lambda *a: (calls.append(1), real[1](*a))[1]
    try:
        model, opt = _build(name)
        net = DistributedDataParallel(model) if ddp_wrap else model
        train_steps(net, opt, data)
    finally:
        fused_sgd_update.step_masters, fused_sgd_update.step = real
    params = [p for g in opt.param_groups for p in g["params"]]
    return {"weights": [p.detach().float().clone() for p in model.parameters()],
            "buffers": [opt.state[p]["momentum_buffer"].clone() for p in params], "calls": len(calls), "fp32": fp32}


def _worker(rank, world_size):
    return {name: _train(name, micro_batches(STEPS, 1, 4, rank, world_size), ddp_wrap=True) for name in LEVELS}


@pytest.fixture(scope="module")
def ranks():
    return run(_worker, 2)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LEVELS))
def test_ranks_agree_bit_for_bit_and_match_one_process(ranks, name):
    a, b = ranks[0][name], ranks[1][name]
    calls = STEPS * (1 if name == "O5" else 2)  # O7: the bf16 weights' fused step, then the fp32 ones'
    assert a["calls"] == b["calls"] == calls
    assert a["fp32"] == b["fp32"] == [2] * STEPS  # BatchNorm's weight and bias, in the fused masters' op
    for key in ("weights", "buffers"):
        assert all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a[key], b[key])), key
    single = _train(name, micro_batches(STEPS, 1, 4))
    assert single["calls"] == calls
    assert [t.dtype for t in a["buffers"]] == [t.dtype for t in single["buffers"]]
    assert a["buffers"][0].dtype == (torch.bfloat16 if name.endswith("bf16_state") else torch.float32)
    for got, want in zip(a["weights"] + a["buffers"], single["weights"] + single["buffers"]):
        torch.testing.assert_close(got.float(), want.float(), **HALF_CLOSE)
