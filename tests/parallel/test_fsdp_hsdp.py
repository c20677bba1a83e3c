"""HSDP: ``initialize(..., fsdp=True, fsdp_kwargs={"mesh": <2 x 2 mesh>})`` on 4 gloo ranks
(replicate across the first dimension, shard along the second).

_matrix.py's 4-rank launch trains every level on the 2-D mesh (and, for the resharding tests,
on a 1-D mesh of 4), saves the 2-D run after SAVE_AT steps and resumes it in the same
processes; its second 2-rank launch (1-D) loads the 2-D checkpoints.
"""
import pytest
import torch

from ._matrix import SAVE_AT
from ._tiny import ALL_LEVELS, BF16, LEVELS, TOLERANCE, assert_state_equal
from .test_fsdp_world_size import _trained, assert_same_optimizer_state

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("level", ALL_LEVELS)
def test_every_level_trains_on_a_2d_mesh_as_on_a_1d_mesh(matrix, level):
    """Parameters replicated over the first mesh dimension, sharded along the second; the
    losses (global means) equal the 1-D run's within the compute dtype's rounding (the
    gradients are summed in another order) and fall."""
    ranks = matrix("4")
    assert set(ranks[0][f"{level}/placements"]) == {("R", "S(0)")}  # replicated, sharded on dim 0
    for rank in ranks:
        assert rank[f"{level}/2d"] == ranks[0][f"{level}/2d"]
    # ranks 0, 1 and 2, 3 are the two replicas of shards 0, 1: they round the same update alike
    for a, b in ((0, 2), (1, 3)):
        assert all(torch.equal(x, y) for x, y in zip(ranks[a][f"{level}/2d/local"], ranks[b][f"{level}/2d/local"]))
    assert not all(torch.equal(x, y) for x, y in zip(ranks[0][f"{level}/2d/local"], ranks[1][f"{level}/2d/local"]))
    got, want = ranks[0][f"{level}/2d"], ranks[0][f"{level}/uninterrupted"]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), **TOLERANCE.get(level, BF16))
    assert got[-1] < got[0]


@pytest.mark.parametrize("level", LEVELS)
def test_2d_checkpoint_resumes_bit_exactly_on_the_2d_mesh(matrix, level):
    ranks = matrix("4")
    for rank in ranks:
        assert rank[f"{level}/2d/resumed"] == rank[f"{level}/2d"][SAVE_AT:]
    got, want = ranks[0][f"{level}/2d/resumed/weights"], ranks[0][f"{level}/2d/weights"]
    assert got.keys() == want.keys() and all(torch.equal(got[k], v) for k, v in want.items())


@pytest.mark.parametrize("level", LEVELS)
def test_2d_checkpoint_loads_into_a_1d_mesh_of_2(matrix, level):
    """The state as saved, bit for bit (O8's too), the rounder's seed and step
    as saved on every rank, training within tolerance."""
    ranks, flat = matrix("4"), matrix("2b")
    assert_state_equal(flat[0][f"{level}/from2x2/loaded"], ranks[0][f"{level}/2d/saved"], level, "2x2 -> 2")
    saved = [rank[f"{level}/2d/saved"]["rounding"] for rank in ranks]
    assert saved == [None if level not in ("O7", "O8") else {"seed": 0, "step": SAVE_AT}] * len(ranks)
    assert [rank[f"{level}/from2x2/rounding0"] for rank in flat] == saved[:len(flat)]
    torch.testing.assert_close(torch.tensor(flat[0][f"{level}/from2x2/losses0"]),
                               torch.tensor(ranks[0][f"{level}/2d"][SAVE_AT:]), **TOLERANCE.get(level, BF16))


def test_o8_on_a_2d_mesh_equals_one_process_bit_for_bit(matrix):
    """Given identical gradients, O8 on the 2 x 2 mesh (shards cut inside blocks stepped in the
    chunks, the whole-block ones by the fused kernel) gives the single process's weights,
    float32 state and stored codes and scales (the replicas' scales equal: ``_gathered``)."""
    single, single_opt = _trained("O8", False)
    got, got_opt = matrix("4")[0]["O8/identical_gradients/2x2"]
    assert got.keys() == single.keys() and all(torch.equal(got[k], single[k]) for k in single)
    assert_same_optimizer_state(got_opt, single_opt, "O8")
