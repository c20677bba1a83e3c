"""O8's fused AdamW under DDP on 2 gloo ranks when an update would write a non-finite weight on
one rank only, in the middle of a chunk: on that rank the op stops at that tensor (the one before
it has written, the one after never steps), on the other every tensor writes; both ranks skip the
step (one flag over the ranks) and put every tensor of the chunk back, bit for bit, and the run
then matches one process that never took that step, over the same batches."""
import pytest
import torch
from torch import nn

import ampkit
from ampkit.parallel import DistributedDataParallel

from ._launch import run

N = 600  # elements per tensor: three tensors of one chunk, three blocks of 256 each
X = {0: 1.0, 1: 0.5}  # each rank's input; their mean 0.75 (exact in bf16) is the one process's


class _Three(nn.Module):
    """Three bf16 weight vectors; the loss is linear in them (its gradient is the input)."""

    def __init__(self):
        super().__init__()
        self.w, self.u, self.v = (nn.Parameter(torch.full((N,), 1.0)) for _ in range(3))

    def forward(self, x):
        return ((self.w + self.u + self.v) * x).sum()


def _build():
    model = _Three()
    opt = torch.optim.Adam([{"params": [model.w]}, {"params": [model.u], "maximize": True}, {"params": [model.v]}],
                           lr=1e-3)
    return ampkit.initialize(model, opt, opt_level="O8", verbosity=0, max_loss_scale=2.0**10)


def _step(model, opt, x: float, forward=None) -> None:
    opt.zero_grad()
    with ampkit.scale_loss((forward or model)(torch.full((N,), x)).float(), opt) as scaled:
        scaled.backward()
    opt.step()


def _snapshot(model, opt) -> list:
    return [t.detach().clone() for p in model.parameters() for t in [p, *opt.state[p].values()]]


def _worker(rank, world_size):
    model, opt = _build()
    ddp = DistributedDataParallel(model)
    _step(model, opt, X[rank], ddp)
    kept = model.u.detach().clone()
    if rank == 1:  # this rank's u at bfloat16's top: its update overflows, rank 0's does not
        with torch.no_grad():
            model.u.fill_(3.3e38)
    before = _snapshot(model, opt)
    opt.param_groups[1]["lr"] = 3e37
    _step(model, opt, X[rank], ddp)
    out = {"skipped": ampkit.step_was_skipped(opt), "unchanged": all(
        torch.equal(a, b) for a, b in zip(before, _snapshot(model, opt)))}
    with torch.no_grad():
        model.u.copy_(kept)
    opt.param_groups[1]["lr"] = 1e-3
    _step(model, opt, X[rank], ddp)
    return {**out, "after": _snapshot(model, opt)}


@pytest.mark.slow
def test_a_non_finite_weight_on_one_rank_skips_the_step_on_both_and_puts_every_tensor_back():
    ranks = run(_worker, 2)
    model, opt = _build()
    for _ in range(2):  # one process, the same batches without the skipped step
        _step(model, opt, sum(X.values()) / len(X))
    single = _snapshot(model, opt)
    for out in ranks:
        assert out["skipped"] and out["unchanged"]
        assert all(torch.equal(a, b) for a, b in zip(out["after"], single))  # the inputs' mean is exact
    assert all(int(s) == 2 for s in single[1::6])  # every tensor stepped twice: its step count
    assert not torch.equal(single[0], torch.ones(N, dtype=torch.bfloat16))  # it trained
