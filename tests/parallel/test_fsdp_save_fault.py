"""A rank killed in the middle of save_sharded: the launch ends (no hang), the earlier
checkpoint still loads, and the partial one is refused with a message that says so."""
import os

import pytest
import torch

from ampkit.parallel import load_sharded, save_sharded

from ._launch import launch, run
from ._tiny import build, snapshot, train

pytestmark = pytest.mark.slow


def _dies_writing(rank):
    """Rank 1 exits (as if killed) after its first file is written: inside ``dcp.save``, after
    the marker, before the metadata."""
    if rank != 1:
        return
    from torch.distributed.checkpoint import filesystem

    write = filesystem.FileSystemWriter.write_data

    def write_then_die(self, plan, planner):
        write(self, plan, planner).wait()
        os._exit(9)

    filesystem.FileSystemWriter.write_data = write_then_die


def save_worker(rank, world_size, root):
    model, opt = build("O7", seed=0)
    train(model, opt, range(1), rank, world_size)
    save_sharded(f"{root}/good", model, opt)
    saved = snapshot(model, opt)
    train(model, opt, range(1, 2), rank, world_size)
    torch.save(saved, f"{root}/saved{rank}.pt")
    _dies_writing(rank)
    save_sharded(f"{root}/partial", model, opt)  # rank 1 dies in here
    return "finished"


def load_worker(rank, world_size, root):
    out = {}
    model, opt = build("O7", seed=100)
    before = snapshot(model, opt)
    try:
        load_sharded(f"{root}/partial", model, opt)
    except ValueError as e:
        out["refused"] = str(e)
    after = snapshot(model, opt)["model"]  # collective: every rank, once
    out["unchanged"] = after.keys() == before["model"].keys() and all(torch.equal(v, before["model"][k]) for k, v in after.items())
    load_sharded(f"{root}/good", model, opt)
    out["good"] = snapshot(model, opt)
    return out


@pytest.fixture(scope="module")
def after_fault(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("fault"))
    outcomes = launch(save_worker, 2, root, timeout=600, pg_timeout=120)
    return root, outcomes, run(load_worker, 2, root, timeout=600, pg_timeout=300)


def test_killed_rank_ends_the_save_without_a_hang(after_fault):
    _, outcomes, _ = after_fault
    assert outcomes[1] == {"ok": False, "error": "died (exit code 9)"}
    assert not outcomes[0]["ok"] and outcomes[0]["error"] != "hung", outcomes[0]["error"]


def test_partial_checkpoint_is_refused_and_the_earlier_one_loads(after_fault):
    root, _, loaded = after_fault
    assert os.path.exists(f"{root}/partial/.ampkit-incomplete")
    for rank, got in enumerate(loaded):
        assert "the checkpoint is incomplete: save_sharded started writing it but did not finish" in got["refused"]
        assert got["unchanged"]
    want, got = torch.load(f"{root}/saved0.pt", weights_only=False), loaded[0]["good"]
    assert want["model"].keys() == got["model"].keys()
    assert all(torch.equal(got["model"][k], v) for k, v in want["model"].items())
    assert got["scalers"] == want["scalers"]
    for rank, state in enumerate(loaded):
        saved = torch.load(f"{root}/saved{rank}.pt", weights_only=False)
        assert state["good"]["rounding"] == saved["rounding"] == {"seed": 0, "step": 1}
