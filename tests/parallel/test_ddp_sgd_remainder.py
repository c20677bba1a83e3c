"""Remainder masters with torch.optim.SGD (momentum, Nesterov, weight decay) under DDP on 2 gloo
ranks against one process over the same batches: every step runs the fused remainder SGD pass
(the fp32 BatchNorm parameters the fused masters' op);
the ranks hold bit-identical weights, remainders, side tables and momentum buffers, whose masters
and buffers equal O5's under DDP bit for bit (its fused SGD masters, the same reduced gradients),
and match one process up to the gradients' summation order."""
import pytest
import torch
from torch import nn

import ampkit
from ampkit._kernels.remainder import master, side_table
from ampkit.parallel import DistributedDataParallel

from ._launch import run
from ._models import micro_batches, train_steps

STEPS = 6
HALF_CLOSE = dict(rtol=2e-2, atol=2e-2)  # bf16 weights and gradients: an ulp of bf16 on values of order 1


def _train(master_weights, data, ddp_wrap=False):
    from ampkit._update import fused_sgd_update
    calls, real = [], fused_sgd_update.step_remainders
    fused_sgd_update.step_remainders = lambda *a: (calls.append(1), real(*a))[1]
    try:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 64), nn.BatchNorm1d(64), nn.Tanh(), nn.Linear(64, 3)).eval()  # running stats:
        net[1].running_mean.uniform_(-0.5, 0.5)  # the same normalization on every rank and in one process
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)
        model, opt = ampkit.initialize(net, opt, opt_level="O5", master_weights=master_weights, verbosity=0)
        wrapped = DistributedDataParallel(model) if ddp_wrap else model
        train_steps(wrapped, opt, data)
    finally:
        fused_sgd_update.step_remainders = real
    params = list(model.parameters())
    if master_weights is True:  # O5: the fp32 masters and their buffers
        masters = [m.detach().clone() for m in ampkit.master_params(opt)]
        return {"masters": masters, "buffers": [opt.state[m]["momentum_buffer"].clone() for m in ampkit.master_params(opt)]}
    rs, half = model._ampkit.remainders, [p for p in params if p.dtype == torch.bfloat16]
    assert len(half) == 4 and model[1].weight.dtype == torch.float32
    return {"weights": [p.detach().clone() for p in half], "remainders": [rs[p].clone() for p in half],
            "tables": [side_table(rs[p]).clone() for p in half],
            "masters": [master(p.detach(), rs[p]) if p in rs else p.detach().clone() for p in params],
            "buffers": [opt.state[p]["momentum_buffer"].clone() for p in params], "calls": len(calls)}


def _worker(rank, world_size):
    data = micro_batches(STEPS, 1, 4, rank, world_size)
    return {"remainder": _train("remainder", data, ddp_wrap=True), "O5": _train(True, data, ddp_wrap=True)}


@pytest.fixture(scope="module")
def ranks():
    return run(_worker, 2)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _same(xs, ys) -> bool:
    return all(x.dtype == y.dtype and torch.equal(_bits(x), _bits(y)) for x, y in zip(xs, ys))


@pytest.mark.slow
def test_ranks_agree_bit_for_bit_equal_o5_and_match_one_process(ranks):
    a, b = ranks[0]["remainder"], ranks[1]["remainder"]
    assert a["calls"] == b["calls"] == STEPS
    for key in ("weights", "remainders", "tables", "masters", "buffers"):
        assert _same(a[key], b[key]), key
    o5 = ranks[0]["O5"]
    assert _same(a["masters"], o5["masters"]) and _same(a["buffers"], o5["buffers"])
    assert all(t.dtype == torch.float32 for t in a["buffers"])
    single = _train("remainder", micro_batches(STEPS, 1, 4))
    assert single["calls"] == STEPS
    for got, want in zip(a["masters"] + a["buffers"], single["masters"] + single["buffers"]):
        torch.testing.assert_close(got, want, **HALF_CLOSE)
