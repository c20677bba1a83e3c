"""A rank that fails must not hang the others: they exit with an error instead of waiting forever.

Nothing here reads a clock: the launcher's deadline only ends a run that would hang, and
the verdict comes from what each rank reports.
"""
import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ampkit.parallel import DistributedDataParallel, convert_syncbn_model

from ._launch import launch
from ._models import batches, make_net, shard

pytestmark = pytest.mark.slow

LINGERED = "rank 1 lingered until rank 0 gave up"


def _train_until_rank1_fails(rank, world_size, linger, marker):
    ddp = DistributedDataParallel(convert_syncbn_model(make_net()))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    try:
        for step, (x, y) in enumerate(shard(b, rank, world_size) for b in batches(world_size, steps=6)):
            if step == 2 and linger:
                # Both ranks are past start-up: from here a missing peer is noticed after a
                # short process-group timeout, however slow the machine was to start.
                dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=5))
            if rank == 1 and step == 2:
                if linger:  # stuck instead (say, in its error handling): alive, but gone from the group
                    while not os.path.exists(marker):
                        time.sleep(0.1)
                    raise RuntimeError(LINGERED)
                raise RuntimeError("injected failure on rank 1")
            opt.zero_grad()
            F.mse_loss(ddp(x), y).backward()
            opt.step()
    except BaseException:
        if rank == 0:
            open(marker, "w").close()
        raise
    return step


def test_peer_exits_after_raising(tmp_path):
    """Rank 1 raises and exits: rank 0, inside a collective, fails on the closed connection."""
    failed, survivor = launch(_train_until_rank1_fails, 2, False, str(tmp_path / "gave_up"),
                              timeout=600, pg_timeout=300)[::-1]
    assert failed["error"] == "RuntimeError: injected failure on rank 1"
    assert not survivor["ok"]
    assert "Traceback" in survivor["traceback"]
    # Gloo notices the peer's closed connection: it does not wait out the 300 s timeout.
    assert "timed out" not in survivor["error"].lower()


def test_peer_lingers_after_raising(tmp_path):
    """Rank 1 stops taking part but stays alive: rank 0 fails at the process-group timeout."""
    survivor, failed = launch(_train_until_rank1_fails, 2, True, str(tmp_path / "gave_up"),
                              timeout=600, pg_timeout=300)
    assert not survivor["ok"]
    assert "timed out" in survivor["error"].lower()  # the process-group timeout ended its wait
    assert failed["error"] == f"RuntimeError: {LINGERED}"  # rank 1 was still alive when rank 0 gave up
