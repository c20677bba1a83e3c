"""Sharded (DCP) checkpoints resumed on another number of ranks (2 -> 1, 3, 4 and 4 -> 2) and
at another level.

One launch per world size does, for every level in sequence: an uninterrupted run of STEPS
steps, and (where it saves) a run saved after SAVE_AT steps, or (where it loads) two loads of
the other size's checkpoint, each continued to STEPS. The global batch (12 samples) is cut
into one equal part per rank at every size. One more launch on 2 ranks loads each level's
2-rank checkpoint at every other level. Each launch also trains O8 on identical gradients
(``test_fsdp_world_size.py``), which gives the single process's weights and state bit for
bit at every size.
"""
import pytest
import torch

from ampkit.parallel import full_state_dict, load_sharded, save_sharded

from ._launch import run
from ._tiny import LEVELS, assert_state_equal, build, snapshot, train
from .test_fsdp_world_size import _trained, assert_same_optimizer_state

pytestmark = pytest.mark.slow

STEPS, SAVE_AT = 4, 2
# Against an uninterrupted run at the new size: the ranks' gradients are sums over other
# groupings of the samples (and FSDP2 sums them in another order), so the losses agree to
# the rounding of the compute dtype, not bit for bit.
TOLERANCE = {"O2": dict(rtol=2e-3, atol=2e-3)}
BF16 = dict(rtol=1e-2, atol=1e-2)
# (saving size, loading size): the parametrized cases and the launches they need
MOVES = [(2, 1), (2, 3), (2, 4), (4, 2)]


def worker(rank, world_size, root, load_from):
    """Per level: ``"<level>/uninterrupted"`` losses; with ``load_from=None`` a checkpoint saved
    after SAVE_AT steps (and its snapshot), else two loads of the ``load_from``-rank checkpoint
    (snapshots after loading and the losses that follow)."""
    out = {"O8/identical_gradients": _trained("O8", True)}
    for level in LEVELS:
        model, opt = build(level, seed=0)
        out[f"{level}/uninterrupted"] = train(model, opt, range(STEPS), rank, world_size)
        if load_from is None:
            model, opt = build(level, seed=0)
            train(model, opt, range(SAVE_AT), rank, world_size)
            out[f"{level}/saved"] = snapshot(model, opt)
            save_sharded(f"{root}/{world_size}/{level}", model, opt)
            continue
        for attempt in (0, 1):
            model, opt = build(level, seed=100 + attempt)
            load_sharded(f"{root}/{load_from}/{level}", model, opt)
            out[f"{level}/loaded{attempt}"] = snapshot(model, opt)
            out[f"{level}/losses{attempt}"] = train(model, opt, range(SAVE_AT, STEPS), rank, world_size)
            out[f"{level}/after{attempt}"] = snapshot(model, opt)["model"]
    return out


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """``launches(world_size, load_from)``: each rank's worker output, launched once."""
    root, done = str(tmp_path_factory.mktemp("reshard")), {}

    def get(world_size, load_from=None):
        if load_from is not None:
            get(load_from)  # the checkpoint it loads
        key = (world_size, load_from)
        if key not in done:
            done[key] = run(worker, world_size, root, load_from, timeout=900, pg_timeout=600)
        return done[key]
    get.root = root
    return get


@pytest.mark.parametrize("saved, loaded", MOVES, ids=[f"{a}to{b}" for a, b in MOVES])
@pytest.mark.parametrize("level", LEVELS)
def test_checkpoint_loads_on_another_number_of_ranks(launches, saved, loaded, level):
    """Model (full_state_dict), optimizer state and loss scalers after the load equal what was
    saved, bit for bit (O8's too: its blocks are the full parameter's, a split block's scale
    its maximum over all shards); training continues within the level's tolerance of an
    uninterrupted run at the new size."""
    want = launches(saved)[0][f"{level}/saved"]
    ranks = launches(loaded, saved)
    got = ranks[0]
    assert_state_equal(got[f"{level}/loaded0"], want, level, f"{saved} -> {loaded} ranks")
    assert all(r[f"{level}/loaded0"]["model"] == {} for r in ranks[1:])  # the full state is rank 0's
    torch.testing.assert_close(torch.tensor(got[f"{level}/losses0"]),
                               torch.tensor(got[f"{level}/uninterrupted"][SAVE_AT:]), **TOLERANCE.get(level, BF16))


@pytest.mark.parametrize("saved, loaded", MOVES, ids=[f"{a}to{b}" for a, b in MOVES])
@pytest.mark.parametrize("level", LEVELS)
def test_two_loads_at_one_size_continue_bit_identically(launches, saved, loaded, level):
    for rank in launches(loaded, saved):
        assert rank[f"{level}/losses0"] == rank[f"{level}/losses1"]
        a, b = rank[f"{level}/after0"], rank[f"{level}/after1"]
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert rank[f"{level}/loaded0"]["rounding"] == rank[f"{level}/loaded1"]["rounding"]


@pytest.mark.parametrize("saved, loaded", MOVES, ids=[f"{a}to{b}" for a, b in MOVES])
@pytest.mark.parametrize("level", ["O7", "O8"])
def test_rounding_continues_from_the_saved_seed_and_step_on_every_shard(launches, saved, loaded, level):
    """The rounding state is seed and step, the same on every shard: every rank of any size
    continues from the saved ones."""
    want = [r[f"{level}/saved"]["rounding"] for r in launches(saved)]
    assert want == [{"seed": 0, "step": SAVE_AT}] * saved
    assert [r[f"{level}/loaded0"]["rounding"] for r in launches(loaded, saved)] == want[:1] * loaded


# -- another level -------------------------------------------------------------------------

def level_worker(rank, world_size, root):
    """Each level's 2-rank checkpoint loaded at every level (``"<saved>-><loaded>"``: the
    snapshot after the load, the losses that follow); and an AdamW checkpoint refused by SGD."""
    out = {}
    for saved in LEVELS:
        for loaded in LEVELS:
            model, opt = build(loaded, seed=100)
            load_sharded(f"{root}/2/{saved}", model, opt)
            out[f"{saved}->{loaded}"] = snapshot(model, opt)
            out[f"{saved}->{loaded}/losses"] = train(model, opt, range(SAVE_AT, STEPS), rank, world_size)
    model, opt = build("O7", seed=100, sgd=True)
    before = full_state_dict(model)
    try:
        load_sharded(f"{root}/2/O5", model, opt)
    except ValueError as e:
        out["refused"] = str(e)
    out["unchanged"] = all(torch.equal(v, before[k]) for k, v in full_state_dict(model).items())
    return out


@pytest.fixture(scope="module")
def across_levels(launches, tmp_path_factory):
    launches(2)
    return run(level_worker, 2, launches.root, timeout=900, pg_timeout=600)


ROUNDED_WEIGHTS = ("O7", "O8")  # bf16 weights without masters: fp32 masters load rounded to nearest


@pytest.mark.parametrize("loaded", LEVELS)
@pytest.mark.parametrize("saved", LEVELS)
def test_checkpoint_loads_at_another_level(launches, across_levels, saved, loaded):
    """Masters (O2, O5, remainder) take the saved float32 model exactly; O7/O8's bf16 weights
    take it rounded to nearest (exact from O7/O8, whose weights are bf16 values); the float32
    optimizer state loads exactly (into O8 from another level: within one code; from O8 exactly);
    loss scalers as saved; O7/O8 continue the saved seed and step, or start at the run's
    seed, step 0, after a level without rounding. Training goes on within bf16 tolerance of an
    uninterrupted run at the new level."""
    want = launches(2)[0][f"{saved}/saved"]
    got = across_levels[0][f"{saved}->{loaded}"]
    if loaded in ROUNDED_WEIGHTS:
        want = {**want, "model": {k: v.bfloat16().float() for k, v in want["model"].items()}}
    assert_state_equal(got, want, loaded, f"{saved} -> {loaded}", rounded=loaded == "O8" and saved != "O8")
    for index, rank in enumerate(across_levels):
        state = rank[f"{saved}->{loaded}"]["rounding"]
        if loaded not in ("O7", "O8"):
            assert state is None
        elif saved in ("O7", "O8"):
            assert state == launches(2)[index][f"{saved}/saved"]["rounding"] == {"seed": 0, "step": SAVE_AT}
        else:  # from a level without rounding: a fresh start
            assert state == {"seed": 0, "step": 0}
    torch.testing.assert_close(torch.tensor(across_levels[0][f"{saved}->{loaded}/losses"]),
                               torch.tensor(launches(2)[0][f"{loaded}/uninterrupted"][SAVE_AT:]), **BF16)


def test_checkpoint_of_another_optimizer_is_refused_naming_both_levels(across_levels):
    for rank in across_levels:
        message = rank["refused"]
        assert "written at O5 on 2 shard(s), loaded at O7 on 2 shard(s)" in message, message
        assert "momentum_buffer" in message, message
        assert rank["unchanged"]


# -- O8 on any number of ranks ---------------------------------------------------------------

SIZES = {1: (1, 2), 2: (2, None), 3: (3, 2), 4: (4, None)}  # ranks: the launch that has them


@pytest.mark.parametrize("ranks", SIZES)
def test_o8_on_any_number_of_ranks_equals_one_process_bit_for_bit(launches, ranks):
    """Given identical gradients, O8's weights, float32 state and stored codes and scales on
    1 to 4 ranks (shards cut inside blocks; on 4 ranks one shard empty) are the single
    process's."""
    single, single_opt = _trained("O8", False)
    got, got_opt = launches(*SIZES[ranks])[0]["O8/identical_gradients"]
    assert got.keys() == single.keys() and all(torch.equal(got[k], single[k]) for k in single)
    assert_same_optimizer_state(got_opt, single_opt, "O8")
