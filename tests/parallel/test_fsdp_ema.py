"""An EMA of a sharded model at O7, O8 and remainder masters, saved and resumed with the run.

``AveragedModel(model)`` deep-copies the model, which FSDP2 refuses ("FSDP does not support
deepcopy", torch's fully_shard; pytorch/pytorch#149138). The documented pattern instead keeps
the EMA as float32 DTensors sharded like the model: clones of ``model.state_dict()`` (float32 at
every level: the exact masters with remainder masters, the widened bf16 weights at O7/O8),
updated in place on each rank's shards, saved in the run's checkpoint:
``save_sharded(dir, model, optimizer, extra={"ema": ema})``.
"""
import pytest
import torch
from ampkit.parallel import full_state_dict, load_sharded, save_sharded

from ._launch import run
from ._tiny import build, train

pytestmark = pytest.mark.slow

LEVELS, STEPS, DECAY = ["O7", "O8", "remainder"], 3, 0.75


def ema_of(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def update(ema, model):
    with torch.no_grad():
        for k, v in model.state_dict().items():
            ema[k].lerp_(v, 1 - DECAY)


def full(ema):
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v.clone() for k, v in ema.items()}


def save_worker(rank, world_size, root):
    out = {}
    for level in LEVELS:
        model, opt = build(level, seed=0)
        ema, states = ema_of(model), [full_state_dict(model)]
        for step in range(STEPS):
            train(model, opt, [step], rank, world_size)
            update(ema, model)
            states.append(full_state_dict(model))
        out[level] = {"ema": full(ema), "states": states}
        save_sharded(f"{root}/{level}", model, opt, extra={"ema": ema, "step": STEPS})
    return out


def load_worker(rank, world_size, root):
    out = {}
    for level in LEVELS:
        model, opt = build(level, seed=100)
        load_sharded(f"{root}/{level}", model, opt)
        extra = {"ema": ema_of(model), "step": 0}  # the template: sharded like this run's model
        load_sharded(f"{root}/{level}", model, opt, extra=extra)
        out[level] = full(extra["ema"])
        out[f"{level}/step"] = extra["step"]
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ema"))
    return run(save_worker, 2, root, timeout=600), run(load_worker, 1, root, timeout=600)


@pytest.mark.parametrize("level", LEVELS)
def test_ema_of_a_sharded_model_accumulates_in_float32(runs, level):
    """Equal, bit for bit, to the same recurrence on the whole float32 states (the update is
    elementwise: shards change nothing)."""
    saved = runs[0][0][level]
    states = saved["states"]
    want = {k: v.clone() for k, v in states[0].items()}
    for state in states[1:]:
        for k, v in state.items():
            want[k].lerp_(v, 1 - DECAY)
    got = saved["ema"]
    assert all(v.dtype == torch.float32 for v in got.values())
    assert got.keys() == want.keys() and all(torch.equal(got[k], v) for k, v in want.items())
    assert any(not torch.equal(got[k], states[-1][k]) for k in got)  # an average, not the last weights


@pytest.mark.parametrize("level", LEVELS)
def test_ema_resumes_with_the_run_on_another_number_of_ranks(runs, level):
    saved, loaded = runs[0][0][level]["ema"], runs[1][0][level]
    assert loaded.keys() == saved.keys() and all(torch.equal(loaded[k], v) for k, v in saved.items())
    assert runs[1][0][f"{level}/step"] == STEPS
