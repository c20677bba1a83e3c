"""The sharded-checkpoint matrix in five launches, one per world size (2 twice): every level
saved and loaded on another number of ranks, at another level, on a 2-D mesh, with an EMA and
in the older layout, the checkpoints shared between the launches.

Each process start costs seconds here, gloo's more; the tiny runs themselves take well under a
second. So each launch does every check of its size in sequence, and the tests
(test_fsdp_resharding.py, test_fsdp_hsdp.py, test_fsdp_ema.py, test_fsdp_old_layout.py) read
what the launches returned (``matrix(name)`` in conftest.py, one launch each per session):

* ``"2"``: every level trained STEPS steps, saved after SAVE_AT (the 2-rank checkpoints); each
  of LEVELS' checkpoints loaded at every level of LEVELS; an SGD run refusing an AdamW
  checkpoint; EMA runs saved; O7/O8 saved in the older layout and loaded twice.
* ``"1"``, ``"3"``: every level uninterrupted at that size; the 2-rank checkpoints loaded; the
  cross-level pairs that load on that size; the EMA checkpoints loaded on 1.
* ``"4"``: as ``"2"``'s saving runs (the 4-rank checkpoints), the 2-rank checkpoints loaded,
  its cross-level pairs; HSDP (2 x 2 mesh) at ALL_LEVELS, LEVELS' runs saved and resumed.
* ``"2b"``: the 4-rank checkpoints loaded on 2, its cross-level pairs, the 2 x 2 mesh's
  checkpoints loaded into a 1-D mesh of 2.

Every launch but ``"2b"`` also trains O8 from identical gradients (test_fsdp_world_size.py's
model, shards cut inside blocks), which must give the single process's weights and state;
``"4"`` on the 2 x 2 mesh too.
"""
import importlib.util

import torch

import ampkit
from ampkit._kernels.rounding import StochasticRounder
from ampkit.parallel import full_state_dict, load_sharded, save_sharded
from ampkit._parallel.reshard import saved_metadata, saved_template

from ._tiny import ALL_LEVELS, LEVELS, MATRIX_LEVELS, build, snapshot, train
from .test_fsdp_world_size import _trained

STEPS, SAVE_AT = 4, 2
HAS_TORCHAO = importlib.util.find_spec("torchao") is not None
# O6 needs torchao's Float8Linear (the ``fp8`` extra): without it O6 is left out
MATRIX = [level for level in MATRIX_LEVELS if level != "O6" or HAS_TORCHAO]
ROUNDED = ("O7", "O7/bf16_state", "O8")  # stochastic rounding: a seed and a step to continue
# loaded twice: the levels that restore more than plain arithmetic (the rounder, the remainders)
TWICE = ROUNDED + ("remainder",)
# name: (world size, the launches it needs first, the size whose checkpoints it loads, its own
# runs of every level: "save" (saved after SAVE_AT, continued), "uninterrupted" or None)
LAUNCHES = {"2": (2, (), None, "save"), "1": (1, ("2",), 2, "uninterrupted"), "3": (3, ("2",), 2, "uninterrupted"),
            "4": (4, ("2",), 2, "save"), "2b": (2, ("4",), 4, None)}
# Cross-level loads on other numbers of ranks: (saved level, saving size, loaded level, launch)
CROSS = [("O5", 2, "O7", "3"), ("O8", 2, "remainder", "4"), ("remainder", 2, "O8", "1"), ("O2", 4, "O5", "2b"),
         ("O7", 4, "O8", "2b")]
EMA_LEVELS, EMA_STEPS, EMA_DECAY = ["O7", "O8", "remainder"], 3, 0.75


def worker(rank, world_size, root, name):
    """What launch ``name`` does (see above): this rank's results by key."""
    out = {}
    if name != "2b":  # O8 from identical gradients on 1 to 4 ranks (test_fsdp_world_size.py's runs)
        out["O8/identical_gradients"] = _trained("O8", True)
    _, _, loads_from, runs = LAUNCHES[name]
    if runs == "save":
        saving_runs(rank, world_size, root, out)
    elif runs == "uninterrupted":
        for level in MATRIX:
            model, opt = build(level, seed=0)
            out[f"{level}/uninterrupted"] = train(model, opt, range(STEPS), rank, world_size)
    if loads_from is not None:
        for level in MATRIX:
            loads(rank, world_size, f"{root}/{loads_from}/{level}", level, out, f"{level}/from{loads_from}",
                  attempts=2 if level in TWICE else 1)
    for saved, size, loaded, where in CROSS:
        if where == name:
            loads(rank, world_size, f"{root}/{size}/{saved}", loaded, out, f"{saved}@{size}->{loaded}")
    if name == "2":
        across_levels(rank, world_size, root, out)
        ema_save(rank, world_size, root, out)
        old_layout(rank, world_size, root, out)
    if name == "1":
        ema_load(rank, world_size, root, out)
        out["averaged_model_refusal"] = averaged_model_refusal()
    if name == "4":
        hsdp(rank, world_size, root, out)
        out["O8/identical_gradients/2x2"] = _trained("O8", True, mesh=_mesh())
    if name == "2b":
        for level in LEVELS:
            loads(rank, world_size, f"{root}/hsdp/{level}", level, out, f"{level}/from2x2")
    return out


def saving_runs(rank, world_size, root, out):
    """Every level: STEPS steps, saved (and snapshotted) after SAVE_AT; the live state's dtypes."""
    for level in MATRIX:
        model, opt = build(level, seed=0)
        losses = train(model, opt, range(SAVE_AT), rank, world_size)
        out[f"{level}/saved"] = snapshot(model, opt)
        save_sharded(f"{root}/{world_size}/{level}", model, opt)
        out[f"{level}/uninterrupted"] = losses + train(model, opt, range(SAVE_AT, STEPS), rank, world_size)
        out[f"{level}/modules"] = sorted({type(m).__name__ for m in model.modules()})
        out[f"{level}/dtypes"] = {"params": sorted({str(p.dtype) for p in model.parameters()}),
                                  "state": sorted({str(v.dtype) for s in opt.state.values() for k, v in s.items()
                                                   if k != "step" and torch.is_tensor(v)})}


def loads(rank, world_size, path, level, out, key, attempts=1):
    """The checkpoint ``path`` loaded at ``level``, ``attempts`` times: the snapshot after the
    first load, the rounder's state after each, the losses that follow; with two attempts, the
    models after them."""
    for attempt in range(attempts):
        model, opt = build(level, seed=100 + attempt)
        load_sharded(path, model, opt)
        if attempt == 0:
            out[f"{key}/loaded"] = snapshot(model, opt)
        out[f"{key}/rounding{attempt}"] = ampkit.state_dict(optimizer=opt).get("stochastic_rounding")
        out[f"{key}/losses{attempt}"] = train(model, opt, range(SAVE_AT, STEPS), rank, world_size)
        if attempts > 1:
            out[f"{key}/after{attempt}"] = full_state_dict(model)


def across_levels(rank, world_size, root, out):
    """Each of LEVELS' 2-rank checkpoints loaded at every level of LEVELS; an AdamW checkpoint
    refused by SGD, which the refusal leaves unchanged."""
    for saved in LEVELS:
        for loaded in LEVELS:
            loads(rank, world_size, f"{root}/2/{saved}", loaded, out, f"{saved}->{loaded}")
    model, opt = build("O7", seed=100, sgd=True)
    before = full_state_dict(model)
    try:
        load_sharded(f"{root}/2/O5", model, opt)
    except ValueError as e:
        out["refused"] = str(e)
    out["unchanged"] = all(torch.equal(v, before[k]) for k, v in full_state_dict(model).items())


# -- HSDP ----------------------------------------------------------------------------------

def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))


def hsdp(rank, world_size, root, out):
    """Every level of ALL_LEVELS on a 2 x 2 mesh (replicate x shard); LEVELS' runs saved after
    SAVE_AT and resumed from that checkpoint in the same processes."""
    mesh = _mesh()
    for level in ALL_LEVELS:
        model, opt = build(level, seed=rank, mesh=mesh)  # every rank starts from rank 0's weights
        out[f"{level}/placements"] = [tuple(map(str, p.placements)) for p in model.parameters()]
        losses = train(model, opt, range(SAVE_AT), rank, world_size)
        if level in LEVELS:
            out[f"{level}/2d/saved"] = snapshot(model, opt)
            save_sharded(f"{root}/hsdp/{level}", model, opt)
        out[f"{level}/2d"] = losses + train(model, opt, range(SAVE_AT, STEPS), rank, world_size)
        out[f"{level}/2d/weights"] = full_state_dict(model)
        out[f"{level}/2d/local"] = [p.to_local().detach().clone() for p in model.parameters()]
        if level in LEVELS:
            model, opt = build(level, seed=100 + rank, mesh=mesh)
            load_sharded(f"{root}/hsdp/{level}", model, opt)
            out[f"{level}/2d/resumed"] = train(model, opt, range(SAVE_AT, STEPS), rank, world_size)
            out[f"{level}/2d/resumed/weights"] = full_state_dict(model)


# -- EMA -----------------------------------------------------------------------------------
# ``AveragedModel(model)`` deep-copies the model, which FSDP2 refuses; the EMA is float32
# DTensors sharded like the model, saved with ``extra={"ema": ema}`` (test_fsdp_ema.py).

def ema_of(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def ema_update(ema, model):
    with torch.no_grad():
        for k, v in model.state_dict().items():
            ema[k].lerp_(v, 1 - EMA_DECAY)


def _full(ema):
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v.clone() for k, v in ema.items()}


def ema_save(rank, world_size, root, out):
    for level in EMA_LEVELS:
        model, opt = build(level, seed=0)
        ema, states = ema_of(model), [full_state_dict(model)]
        for step in range(EMA_STEPS):
            train(model, opt, [step], rank, world_size)
            ema_update(ema, model)
            states.append(full_state_dict(model))
        out[f"ema/{level}"] = {"ema": _full(ema), "states": states}
        save_sharded(f"{root}/ema/{level}", model, opt, extra={"ema": ema, "step": EMA_STEPS})


def averaged_model_refusal() -> str:
    """What ``AveragedModel`` of a plain ``fully_shard`` model raises (no ampkit involved): the
    reason the EMA above is kept as shards (pytorch/pytorch#149138)."""
    from torch.distributed.fsdp import fully_shard
    from torch.optim.swa_utils import AveragedModel
    try:
        AveragedModel(fully_shard(torch.nn.Linear(4, 4)))
    except Exception as e:  # torch's AssertionError today; any refusal is recorded
        return f"{type(e).__name__}: {e}"
    return ""


def ema_load(rank, world_size, root, out):
    """One load per checkpoint, the run and its EMA together; the template is sharded like this
    run's model."""
    for level in EMA_LEVELS:
        model, opt = build(level, seed=100)
        extra = {"ema": ema_of(model), "step": 0}
        load_sharded(f"{root}/ema/{level}", model, opt, extra=extra)
        out[f"ema/{level}/loaded"] = _full(extra["ema"])
        out[f"ema/{level}/step"] = extra["step"]
        out[f"ema/{level}/model"] = full_state_dict(model)


# -- the older layout ----------------------------------------------------------------------

def _save_old_layout(checkpoint_id, model, opt, rank):
    """``save_sharded`` with the rounder's state as older versions wrote it: plus each rank's
    generator states as its row of a DTensor."""
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


def old_layout(rank, world_size, root, out):
    """O7 and O8 saved after SAVE_AT in the older layout, loaded twice and continued (to
    compare with the saving run's own continuation, ``"<level>/uninterrupted"``)."""
    for level in ("O7", "O8"):
        model, opt = build(level, seed=0)
        train(model, opt, range(SAVE_AT), rank, world_size)
        out[f"old/{level}/saved"] = snapshot(model, opt)["rounding"]
        _save_old_layout(f"{root}/old/{level}", model, opt, rank)
        template = saved_template(saved_metadata(f"{root}/old/{level}"), "amp")
        out[f"old/{level}/rows"] = tuple(template["stochastic_rounding"]["generators"]["cpu"].shape)
        loads(rank, world_size, f"{root}/old/{level}", level, out, f"old/{level}", attempts=2)
