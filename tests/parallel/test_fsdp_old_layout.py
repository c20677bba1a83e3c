"""Sharded checkpoints in the layout of earlier versions, whose O7/O8 rounder saved each
rank's generator states as its row of a DTensor: they load (the rows are ignored) and the
run continues from the saved seed and step, bit-exactly, as from a current checkpoint."""
import pytest
import torch

from ampkit.core.rounding import StochasticRounder
from ampkit.parallel import load_sharded, save_sharded
from ampkit.parallel.reshard import saved_metadata, saved_template

from ._launch import run
from ._tiny import build, snapshot, train

pytestmark = pytest.mark.slow

STEPS, SAVE_AT = 4, 2
ROUNDED = ("O7", "O8")


def _save_old_layout(checkpoint_id, model, opt, rank):
    """``save_sharded`` with the rounder's state as older versions wrote it: plus generator rows."""
    from torch.distributed.tensor import DTensor, Shard

    mesh = next(model.parameters()).device_mesh
    row = torch.Generator().manual_seed(1000 + rank).get_state().unsqueeze(0)  # each rank's own, as they were
    rows = {"cpu": DTensor.from_local(row, mesh, [Shard(0)], run_check=False)}
    real = StochasticRounder.state_dict
    StochasticRounder.state_dict = lambda self: {**real(self), "generators": rows}
    try:
        save_sharded(checkpoint_id, model, opt)
    finally:
        StochasticRounder.state_dict = real


def worker(rank, world_size, root):
    out = {}
    for level in ROUNDED:
        model, opt = build(level, seed=0)
        train(model, opt, range(SAVE_AT), rank, world_size)
        out[f"{level}/saved"] = snapshot(model, opt)["rounding"]
        _save_old_layout(f"{root}/{level}", model, opt, rank)
        template = saved_template(saved_metadata(f"{root}/{level}"), "amp")
        out[f"{level}/rows"] = tuple(template["stochastic_rounding"]["generators"]["cpu"].shape)
        out[f"{level}/continued"] = train(model, opt, range(SAVE_AT, STEPS), rank, world_size)
        for attempt in (0, 1):
            model, opt = build(level, seed=100 + attempt)
            load_sharded(f"{root}/{level}", model, opt)
            out[f"{level}/loaded{attempt}"] = snapshot(model, opt)["rounding"]
            out[f"{level}/losses{attempt}"] = train(model, opt, range(SAVE_AT, STEPS), rank, world_size)
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run(worker, 2, str(tmp_path_factory.mktemp("old")), timeout=900, pg_timeout=600)


@pytest.mark.parametrize("level", ROUNDED)
def test_an_old_sharded_checkpoint_with_generator_rows_loads_and_continues_bit_exactly(ranks, level):
    for rank in ranks:
        assert rank[f"{level}/rows"][0] == 2  # the checkpoint holds one generator row per rank
        assert rank[f"{level}/saved"] == {"seed": 0, "step": SAVE_AT}
        assert rank[f"{level}/loaded0"] == rank[f"{level}/loaded1"] == rank[f"{level}/saved"]
        assert rank[f"{level}/losses0"] == rank[f"{level}/losses1"] == rank[f"{level}/continued"]
