"""Sharded (DCP) checkpoints resumed on another number of ranks (2 -> 1, 3, 4 and 4 -> 2) and
at another level, at every level (O7 also with bf16 optimizer state).

The launches are _matrix.py's, one per world size, shared with the HSDP, EMA and old-layout
tests: the 2- and 4-rank launches train every level STEPS steps and save it after SAVE_AT (so
their losses are the uninterrupted runs at 2 and 4 ranks); the 1- and 3-rank launches run
every level uninterrupted; each loading launch loads every level's checkpoint of the other
size (the levels with a rounder or remainders twice) and continues to STEPS. The global batch
(12 samples) is cut into one equal part per rank at every size. The 2-rank launch also loads
each of LEVELS' checkpoints at every other level of LEVELS; a few cross-level pairs load on
other sizes (_matrix.CROSS).
"""
import pytest
import torch

from ._matrix import CROSS, HAS_TORCHAO, ROUNDED, SAVE_AT, TWICE
from ._tiny import BF16, LEVELS, MATRIX_LEVELS, TOLERANCE, assert_state_equal
from .test_fsdp_world_size import _trained, assert_same_optimizer_state

pytestmark = pytest.mark.slow

# (saving size, loading size, the loading launch)
MOVES = [(2, 1, "1"), (2, 3, "3"), (2, 4, "4"), (4, 2, "2b")]
MOVE_IDS = [f"{a}to{b}" for a, b, _ in MOVES]
UNINTERRUPTED = {1: "1", 2: "2", 3: "3", 4: "4"}  # the launch that ran each size uninterrupted
SAVED = {2: "2", 4: "4"}
ROUNDED_WEIGHTS = ("O7", "O8")  # bf16 weights without masters: fp32 masters load rounded to nearest
needs_level = {"O6": pytest.mark.skipif(not HAS_TORCHAO, reason="O6 needs torchao (pip install -e '.[fp8]')")}
ALL = [pytest.param(level, marks=needs_level.get(level, ())) for level in MATRIX_LEVELS]


def rounded_state(saved, loaded) -> bool:
    """Whether ``assert_state_equal`` compares the loaded state within one 8-bit code: float32
    state of another level quantized into O8. O8's own state loads exactly on any number of
    shards (its blocks are the full parameter's); everything else exactly."""
    return loaded == "O8" and saved != "O8"


def _uninterrupted(matrix, size, level):
    return torch.tensor(matrix(UNINTERRUPTED[size])[0][f"{level}/uninterrupted"][SAVE_AT:])


@pytest.mark.parametrize("level", ALL)
def test_every_level_runs_as_named(matrix, level):
    """What the matrix covers: fp8 blocks at O6, bf16 weights without masters at O7/O8 and
    with remainders, bf16 optimizer state where asked for, fp16 weights and state at O3."""
    got = matrix("2")[0]
    dtypes = {"O3": ["torch.float16"], "O7": ["torch.bfloat16"], "O7/bf16_state": ["torch.bfloat16"],
              "O8": ["torch.bfloat16"], "remainder": ["torch.bfloat16"]}.get(level, ["torch.float32"])
    assert got[f"{level}/dtypes"]["params"] == dtypes
    state = {"O3": ["torch.float16"], "O7/bf16_state": ["torch.bfloat16"],
             "O8": ["torch.float32", "torch.int8", "torch.uint8"]}.get(level, ["torch.float32"])
    assert got[f"{level}/dtypes"]["state"] == state
    assert ("Float8Linear" in got[f"{level}/modules"]) == (level == "O6")


@pytest.mark.parametrize("saved, loaded, launch", MOVES, ids=MOVE_IDS)
@pytest.mark.parametrize("level", ALL)
def test_checkpoint_loads_on_another_number_of_ranks(matrix, saved, loaded, launch, level):
    """Model (full_state_dict), optimizer state (dtypes too) and loss scalers after the load
    equal what was saved, bit for bit (O8's too: its blocks are the full parameter's, a split
    block's scale its maximum over all shards); training continues within
    the level's tolerance of an uninterrupted run at the new size."""
    want = matrix(SAVED[saved])[0][f"{level}/saved"]
    ranks = matrix(launch)
    got = ranks[0][f"{level}/from{saved}/loaded"]
    assert_state_equal(got, want, level, f"{saved} -> {loaded} ranks", rounded=rounded_state(level, level))
    assert all(r[f"{level}/from{saved}/loaded"]["model"] == {} for r in ranks[1:])  # the full state is rank 0's
    assert [r[f"{level}/from{saved}/loaded"]["scalers"] for r in ranks] == [want["scalers"]] * loaded
    losses = torch.tensor(ranks[0][f"{level}/from{saved}/losses0"])
    torch.testing.assert_close(losses, _uninterrupted(matrix, loaded, level), **TOLERANCE.get(level, BF16))


@pytest.mark.parametrize("saved, loaded, launch", MOVES, ids=MOVE_IDS)
@pytest.mark.parametrize("level", TWICE)
def test_two_loads_at_one_size_continue_bit_identically(matrix, saved, loaded, launch, level):
    for rank in matrix(launch):
        key = f"{level}/from{saved}"
        assert rank[f"{key}/losses0"] == rank[f"{key}/losses1"]
        a, b = rank[f"{key}/after0"], rank[f"{key}/after1"]
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert rank[f"{key}/rounding0"] == rank[f"{key}/rounding1"]


@pytest.mark.parametrize("saved, loaded, launch", MOVES, ids=MOVE_IDS)
@pytest.mark.parametrize("level", ROUNDED)
def test_rounding_continues_from_the_saved_seed_and_step_on_every_shard(matrix, saved, loaded, launch, level):
    """The rounding state is seed and step, the same on every shard: every rank of any size
    continues from the saved ones."""
    want = [r[f"{level}/saved"]["rounding"] for r in matrix(SAVED[saved])]
    assert want == [{"seed": 0, "step": SAVE_AT}] * saved
    assert [r[f"{level}/from{saved}/rounding0"] for r in matrix(launch)] == want[:1] * loaded


# -- another level -------------------------------------------------------------------------

def _assert_loaded_at_another_level(matrix, saved, saved_size, loaded, ranks, key):
    """Masters (O2, O5, remainder) take the saved float32 model exactly; O7/O8's bf16 weights
    take it rounded to nearest (exact from O7/O8, whose weights are bf16 values); the float32
    optimizer state loads exactly (O8: see ``rounded_state``); loss scalers as saved; O7/O8
    continue the saved seed and step, or start at the run's seed, step 0, after a level without
    rounding. Training goes on within bf16 tolerance of an uninterrupted run at the new level
    and size."""
    want = matrix(SAVED[saved_size])[0][f"{saved}/saved"]
    if loaded in ROUNDED_WEIGHTS:
        want = {**want, "model": {k: v.bfloat16().float() for k, v in want["model"].items()}}
    assert_state_equal(ranks[0][f"{key}/loaded"], want, loaded, key, rounded=rounded_state(saved, loaded))
    assert all(r[f"{key}/loaded"]["model"] == {} for r in ranks[1:])  # the full state is rank 0's
    for rank in ranks:
        state = rank[f"{key}/loaded"]["rounding"]
        if loaded not in ROUNDED:
            assert state is None
        elif saved in ROUNDED:
            assert state == {"seed": 0, "step": SAVE_AT}
        else:  # from a level without rounding: a fresh start
            assert state == {"seed": 0, "step": 0}
    torch.testing.assert_close(torch.tensor(ranks[0][f"{key}/losses0"]), _uninterrupted(matrix, len(ranks), loaded),
                               **BF16)


@pytest.mark.parametrize("loaded", LEVELS)
@pytest.mark.parametrize("saved", LEVELS)
def test_checkpoint_loads_at_another_level(matrix, saved, loaded):
    """(At the same level and size: bit-identical to the uninterrupted run.)"""
    ranks = matrix("2")
    _assert_loaded_at_another_level(matrix, saved, 2, loaded, ranks, f"{saved}->{loaded}")
    if saved == loaded:
        assert all(r[f"{saved}->{loaded}/losses0"] == r[f"{saved}/uninterrupted"][SAVE_AT:] for r in ranks)


@pytest.mark.parametrize("saved, saved_size, loaded, launch", CROSS,
                         ids=[f"{s}@{n}-to-{l}@{w}" for s, n, l, w in CROSS])
def test_checkpoint_loads_at_another_level_on_another_number_of_ranks(matrix, saved, saved_size, loaded, launch):
    key = f"{saved}@{saved_size}->{loaded}"
    _assert_loaded_at_another_level(matrix, saved, saved_size, loaded, matrix(launch), key)


def test_checkpoint_of_another_optimizer_is_refused_naming_both_levels(matrix):
    for rank in matrix("2"):
        message = rank["refused"]
        assert "written at O5 on 2 shard(s), loaded at O7 on 2 shard(s)" in message, message
        assert "momentum_buffer" in message, message
        assert rank["unchanged"]



@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_o8_on_any_number_of_ranks_equals_one_process_bit_for_bit(matrix, ranks):
    """Given identical gradients, O8's weights, float32 state and stored codes and scales on
    1 to 4 ranks (shards cut inside blocks; on 4 ranks one shard empty) are the single
    process's."""
    single, single_opt = _trained("O8", False)
    got, got_opt = matrix(str(ranks))[0]["O8/identical_gradients"]
    assert got.keys() == single.keys() and all(torch.equal(got[k], single[k]) for k in single)
    assert_same_optimizer_state(got_opt, single_opt, "O8")
