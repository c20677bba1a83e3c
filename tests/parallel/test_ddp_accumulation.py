"""Gradient accumulation under DDP on 2 gloo ranks, at every level, against one process.

Each step runs three micro-batches: two under ``no_sync()`` and one synchronizing, each in
its own ``scale_loss`` (plain, or ``delay_unscale=True`` on the ``no_sync`` ones), with
ampkit's ``DistributedDataParallel`` and with torch's own around an initialized model (what
``accelerator.prepare`` builds). The ranks must hold bit-identical weights, equal to one
process over the same micro-batches up to summation order, after one gradient reduction
per step.
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampkit
from ampkit.parallel import DistributedDataParallel

from ._launch import run
from ._models import micro_batches

LEVELS = {"O0": {}, "O1": {}, "O2": {}, "O3": {}, "O4": {}, "O5": {}, "O7": {}, "O8": {},
          "O7/bf16_state": {"optimizer_state_dtype": torch.bfloat16}, "remainder": {"master_weights": "remainder"}}
WRAPPERS = ("ampkit", "torch")
MODES = ("plain", "delay_unscale")
STEPS, MICRO, PER_RANK = 3, 3, 4
CLOSE = {"O0": dict(rtol=1e-5, atol=1e-6), "O1": dict(rtol=1e-3, atol=1e-3), "O4": dict(rtol=4e-3, atol=4e-3)}
HALF_CLOSE = dict(rtol=2e-2, atol=2e-2)  # half weights: an ulp of bf16 on values of order 1


def _level(name):
    return "O5" if name == "remainder" else name.split("/")[0]


def _build(name):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    return ampkit.initialize(net, opt, opt_level=_level(name), verbosity=0, max_loss_scale=2.0**10, **LEVELS[name])


def _train(model, opt, data, mode, ddp=None):
    for step in data:
        opt.zero_grad()
        for i, (x, y) in enumerate(step):
            local = i < MICRO - 1
            with (ddp.no_sync() if ddp is not None and local else _nothing()):
                loss = F.mse_loss((ddp or model)(x), y) / MICRO
                with ampkit.scale_loss(loss, opt, delay_unscale=mode == "delay_unscale" and local) as scaled:
                    scaled.backward()
        opt.step()
    return [p.detach().float().clone() for p in model.parameters()]


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _worker(rank, world_size):
    import torch.distributed as dist

    reductions = [0]
    all_reduce = dist.all_reduce

    def counted(tensor, *args, **kwargs):
        reductions[0] += tensor.is_floating_point() and tensor.numel() > 1  # not the overflow flag (one element)
        return all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = counted
    out = {}
    for name in LEVELS:
        for wrapper in WRAPPERS:
            for mode in MODES:
                model, opt = _build(name)
                ddp = (DistributedDataParallel(model) if wrapper == "ampkit"
                       else torch.nn.parallel.DistributedDataParallel(model))
                reductions[0] = 0
                weights = _train(model, opt, micro_batches(STEPS, MICRO, PER_RANK, rank), mode, ddp)
                out[name, wrapper, mode] = {"weights": weights, "reductions": reductions[0]}
    return out


@pytest.fixture(scope="module")
def ranks():
    return run(_worker, 2)


@pytest.fixture(scope="module")
def single():
    out = {}
    for name in LEVELS:
        for mode in MODES:
            model, opt = _build(name)
            out[name, mode] = _train(model, opt, micro_batches(STEPS, MICRO, PER_RANK), mode)
    return out


CASES = [(n, w, m) for n in LEVELS for w in WRAPPERS for m in MODES]


@pytest.mark.slow
@pytest.mark.parametrize("name,wrapper,mode", CASES)
def test_ranks_agree_bit_for_bit_and_match_one_process(ranks, single, name, wrapper, mode):
    a, b = (r[name, wrapper, mode]["weights"] for r in ranks)
    assert all(torch.equal(x, y) for x, y in zip(a, b)), "the ranks' weights differ after accumulation"
    close = CLOSE.get(_level(name), HALF_CLOSE)
    for got, want in zip(a, single[name, mode]):
        torch.testing.assert_close(got, want, **close)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["O0", "O2", "O5", "O7"])
def test_one_gradient_reduction_per_step(ranks, name):
    """ampkit's DDP reduces each step's window once; under torch's DDP, ampkit's reduction is the only one."""
    for wrapper in WRAPPERS:
        for mode in MODES:
            assert ranks[0][name, wrapper, mode]["reductions"] == STEPS


@pytest.mark.parametrize("level", ["O2", "O5"])
def test_delay_unscale_sums_half_gradients_in_float32(single, level):
    """With master weights a window held scaled adds its micro-batches in fp32: with a power-of-two
    scale, the same bits as unscaling each micro-batch first."""
    for got, want in zip(single[level, "delay_unscale"], single[level, "plain"]):
        assert torch.equal(got, want)
