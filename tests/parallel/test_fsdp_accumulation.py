"""Gradient accumulation on FSDP2 (``set_requires_gradient_sync(False)`` micro-batches), 2 gloo ranks.

Each step runs three micro-batches, the first two with FSDP2's gradient sync off, each in its
own ``scale_loss`` (plain, or ``delay_unscale=True`` on the unsynchronized ones): FSDP2 sums
them unsharded in float32 and reduce-scatters the sum once. The ranks must hold the same
full weights, equal to one process over the same micro-batches up to summation order.
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampkit

from ._launch import run
from ._models import micro_batches

pytestmark = pytest.mark.slow

LEVELS = {"O2": {}, "O5": {}, "O7": {}, "O8": {}, "O7/bf16_state": {"optimizer_state_dtype": torch.bfloat16},
          "remainder": {"master_weights": "remainder"}}
MODES = ("plain", "delay_unscale")
STEPS, MICRO, PER_RANK = 3, 3, 4
CLOSE = {"O2": dict(rtol=2e-3, atol=2e-3)}
HALF_CLOSE = dict(rtol=2e-2, atol=2e-2)


def _build(name, fsdp):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    level = "O5" if name == "remainder" else name.split("/")[0]
    return ampkit.initialize(net, opt, opt_level=level, verbosity=0, max_loss_scale=2.0**10, fsdp=fsdp, **LEVELS[name])


def _train(model, opt, data, mode, sharded):
    for step in data:
        opt.zero_grad()
        for i, (x, y) in enumerate(step):
            local = i < MICRO - 1
            if sharded:
                model.set_requires_gradient_sync(not local)
            loss = F.mse_loss(model(x), y) / MICRO
            with ampkit.scale_loss(loss, opt, delay_unscale=mode == "delay_unscale" and local) as scaled:
                scaled.backward()
        opt.step()
    full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
    return [p.detach().float().clone() for p in full]


def _worker(rank, world_size):
    out = {}
    for name in LEVELS:
        for mode in MODES:
            model, opt = _build(name, fsdp=True)
            out[name, mode] = _train(model, opt, micro_batches(STEPS, MICRO, PER_RANK, rank), mode, sharded=True)
    return out


@pytest.fixture(scope="module")
def ranks():
    return run(_worker, 2)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(LEVELS))
def test_ranks_agree_and_match_one_process(ranks, name, mode):
    a, b = (r[name, mode] for r in ranks)
    assert all(torch.equal(x, y) for x, y in zip(a, b)), "the ranks' weights differ after accumulation"
    model, opt = _build(name, fsdp=False)
    want = _train(model, opt, micro_batches(STEPS, MICRO, PER_RANK), mode, sharded=False)
    for got, w in zip(a, want):
        torch.testing.assert_close(got, w, **CLOSE.get(name, HALF_CLOSE))
