"""A rank that fails must not hang the others: they exit with an error, in bounded time."""
import time

import torch
import torch.nn.functional as F

from ampkit.parallel import DistributedDataParallel, convert_syncbn_model

from ._launch import launch
from ._models import batches, make_net, shard


def _train_until_rank1_fails(rank, world_size, linger):
    ddp = DistributedDataParallel(convert_syncbn_model(make_net()))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step, (x, y) in enumerate(shard(b, rank, world_size) for b in batches(world_size, steps=6)):
        if rank == 1 and step == 2:
            if linger:  # stuck instead (say, in its error handling): the process stays alive
                time.sleep(60)
            raise RuntimeError("injected failure on rank 1")
        opt.zero_grad()
        F.mse_loss(ddp(x), y).backward()
        opt.step()
    return step


def test_peer_exits_after_raising():
    """Rank 1 raises and exits: rank 0, inside a collective, fails at once."""
    start = time.time()
    failed, survivor = launch(_train_until_rank1_fails, 2, False, timeout=30, pg_timeout=20)[::-1]
    assert failed["error"] == "RuntimeError: injected failure on rank 1"
    assert not survivor["ok"]
    assert "Traceback" in survivor["traceback"]
    # Gloo sees the closed connection at once: far sooner than the process-group timeout.
    assert survivor["exit_time"] - failed["exit_time"] < 10
    assert time.time() - start < 30


def test_peer_lingers_after_raising():
    """Rank 1 stops taking part but stays alive: rank 0 fails at the process-group timeout."""
    start = time.time()
    survivor, failed = launch(_train_until_rank1_fails, 2, True, timeout=10, pg_timeout=2)
    assert failed["error"] == "hung"  # killed by the launcher at its deadline
    assert not survivor["ok"]
    assert "timed out" in survivor["error"].lower()  # the process-group timeout ended its wait
    assert survivor["exit_time"] - start < 10
    assert time.time() - start < 20
