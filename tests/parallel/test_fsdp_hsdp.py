"""HSDP: ``initialize(..., fsdp=True, fsdp_kwargs={"mesh": <2 x 2 mesh>})`` on 4 gloo ranks
(replicate across the first dimension, shard along the second).

One 4-rank launch trains every level on the 2-D mesh and on a 1-D mesh of 4, saves the 2-D
run after SAVE_AT steps and resumes it in the same processes; a 2-rank launch (1-D) loads the
2-D checkpoints.
"""
import pytest
import torch

from ampkit.parallel import load_sharded, save_sharded

from ._launch import run
from ._tiny import ALL_LEVELS, LEVELS, assert_state_equal, build, snapshot, train

pytestmark = pytest.mark.slow

STEPS, SAVE_AT = 4, 2
BF16 = dict(rtol=1e-2, atol=1e-2)
TOLERANCE = {"O0": dict(rtol=1e-5, atol=1e-6), "O1": dict(rtol=2e-3, atol=2e-3), "O2": dict(rtol=2e-3, atol=2e-3),
             "O3": dict(rtol=2e-3, atol=2e-3)}


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))


def hsdp_worker(rank, world_size, root):
    mesh, out = _mesh(), {}
    for level in ALL_LEVELS:
        model, opt = build(level, seed=rank)  # every rank starts from rank 0's weights
        out[f"{level}/1d"] = train(model, opt, range(STEPS), rank, world_size)
        model, opt = build(level, seed=rank, mesh=mesh)
        out[f"{level}/placements"] = [tuple(map(str, p.placements)) for p in model.parameters()]
        out[f"{level}/2d"] = train(model, opt, range(STEPS), rank, world_size)
        out[f"{level}/2d/weights"] = snapshot(model, opt)["model"]
        out[f"{level}/2d/local"] = [p.to_local().detach().clone() for p in model.parameters()]
        if level not in LEVELS:
            continue
        model, opt = build(level, seed=rank, mesh=mesh)
        train(model, opt, range(SAVE_AT), rank, world_size)
        out[f"{level}/saved"] = snapshot(model, opt)
        save_sharded(f"{root}/{level}", model, opt)
        model, opt = build(level, seed=100 + rank, mesh=mesh)
        load_sharded(f"{root}/{level}", model, opt)
        out[f"{level}/resumed"] = train(model, opt, range(SAVE_AT, STEPS), rank, world_size)
        out[f"{level}/resumed/weights"] = snapshot(model, opt)["model"]
    return out


def flat_worker(rank, world_size, root):
    out = {}
    for level in LEVELS:
        model, opt = build(level, seed=100)
        load_sharded(f"{root}/{level}", model, opt)
        out[f"{level}/loaded"] = snapshot(model, opt)
        out[f"{level}/losses"] = train(model, opt, range(SAVE_AT, STEPS), rank, world_size)
    return out


@pytest.fixture(scope="module")
def hsdp(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("hsdp"))
    return root, run(hsdp_worker, 4, root, timeout=900, pg_timeout=600)


@pytest.fixture(scope="module")
def flat(hsdp):
    return run(flat_worker, 2, hsdp[0], timeout=900, pg_timeout=600)


@pytest.mark.parametrize("level", ALL_LEVELS)
def test_every_level_trains_on_a_2d_mesh_as_on_a_1d_mesh(hsdp, level):
    """Parameters replicated over the first mesh dimension, sharded along the second; the
    losses (global means) equal the 1-D run's within the compute dtype's rounding (the
    gradients are summed in another order) and fall."""
    _, ranks = hsdp
    assert set(ranks[0][f"{level}/placements"]) == {("R", "S(0)")}  # replicated, sharded on dim 0
    for rank in ranks:
        assert rank[f"{level}/2d"] == ranks[0][f"{level}/2d"]
    # ranks 0, 1 and 2, 3 are the two replicas of shards 0, 1: they round the same update alike
    for a, b in ((0, 2), (1, 3)):
        assert all(torch.equal(x, y) for x, y in zip(ranks[a][f"{level}/2d/local"], ranks[b][f"{level}/2d/local"]))
    assert not all(torch.equal(x, y) for x, y in zip(ranks[0][f"{level}/2d/local"], ranks[1][f"{level}/2d/local"]))
    got, want = ranks[0][f"{level}/2d"], ranks[0][f"{level}/1d"]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), **TOLERANCE.get(level, BF16))
    assert got[-1] < got[0]


@pytest.mark.parametrize("level", LEVELS)
def test_2d_checkpoint_resumes_bit_exactly_on_the_2d_mesh(hsdp, level):
    _, ranks = hsdp
    for rank in ranks:
        assert rank[f"{level}/resumed"] == rank[f"{level}/2d"][SAVE_AT:]
    got, want = ranks[0][f"{level}/resumed/weights"], ranks[0][f"{level}/2d/weights"]
    assert got.keys() == want.keys() and all(torch.equal(got[k], v) for k, v in want.items())


@pytest.mark.parametrize("level", LEVELS)
def test_2d_checkpoint_loads_into_a_1d_mesh_of_2(hsdp, flat, level):
    """The state as saved, bit for bit (O8's too), the rounder's seed and step
    as saved on every rank, training within tolerance."""
    _, ranks = hsdp
    assert_state_equal(flat[0][f"{level}/loaded"], ranks[0][f"{level}/saved"], level, "2x2 -> 2")
    saved = [rank[f"{level}/saved"]["rounding"] for rank in ranks]
    assert saved == [None if level not in ("O7", "O8") else {"seed": 0, "step": SAVE_AT}] * len(ranks)
    assert [rank[f"{level}/loaded"]["rounding"] for rank in flat] == saved[:len(flat)]
    torch.testing.assert_close(torch.tensor(flat[0][f"{level}/losses"]),
                               torch.tensor(ranks[0][f"{level}/2d"][SAVE_AT:]), **TOLERANCE.get(level, BF16))
