"""Whole-run checkpoints: model, optimizer and loss scalers in one file, all or nothing.

``save(path, model, optimizer)`` writes the documented recipe (``model.state_dict()``,
``optimizer.state_dict()`` and every loss scaler's Apex-format state) plus a SHA-256
digest of it, atomically: the file at ``path`` is always either the previous complete
checkpoint or the new complete one, even if the process is killed mid-save.

``load(path, model, optimizer)`` reads the whole file into memory, verifies the digest
(``torch.load`` itself does not notice flipped bytes), checks all three parts against
the model, the optimizer and its ``initialize`` call, and only then applies them; if
applying still fails, what was applied is rolled back. A truncated, corrupted or
mismatched file raises `CheckpointError` and leaves everything as it was.

The file stays an ordinary ``torch.save`` file: ``torch.load(path)["model"]`` is a
float32 state dict that loads into a plain model for inference elsewhere.
"""
import argparse
import collections
import copy
import ctypes
import hashlib
import io
import os
import uuid
from typing import Optional

import torch
from torch import nn

from .._common.files import fsync_dir
from .._kernels.rounding import StochasticRounder
from .._optim.optimizer_wrappers import unwrap
from .._parallel.fsdp import is_sharded
from .._run.run import ROUNDING_KEY as ROUNDING
from .._run.scaler import LossScaler

__all__ = ["CheckpointError", "save", "load"]

FORMAT = "ampkit.checkpoint"
VERSION = 1


class CheckpointError(RuntimeError):
    """The checkpoint file is truncated, corrupted, or does not fit the model/optimizer."""


# --- the run an optimizer belongs to ---------------------------------------------------

def _check_kinds(caller: str, model, optimizer) -> None:
    """``(path, model, optimizer)``: each argument of the kind it names."""
    swapped = " (the arguments are path, model, optimizer: swapped?)"
    if not isinstance(model, nn.Module):
        raise TypeError(f"ampkit.checkpoint.{caller}(model=...): expected an nn.Module, got a {type(model).__name__}"
                        f"{swapped if hasattr(model, 'param_groups') else ''}.")
    if not hasattr(optimizer, "param_groups") or isinstance(optimizer, nn.Module):
        raise TypeError(f"ampkit.checkpoint.{caller}(optimizer=...): expected an optimizer returned by ampkit.initialize, "
                        f"got a {type(optimizer).__name__}{swapped if isinstance(optimizer, nn.Module) else ''}.")


def _run_of(optimizer, caller: str):
    state = getattr(optimizer, "_ampkit", None)
    if state is None:
        raise ValueError(
            f"ampkit.checkpoint.{caller}(optimizer=...): this {type(optimizer).__name__} did not go through "
            f"ampkit.initialize; call initialize (with the same opt_level as the run that saved) first."
        )
    return state.run


def _refuse_sharded(model: nn.Module, caller: str) -> None:
    if is_sharded(model):
        raise ValueError(
            f"ampkit.checkpoint.{caller}(model=...): the model is sharded with FSDP2 (fully_shard); one file "
            f"per run cannot hold every rank's shards. Use ampkit.parallel.{caller}_sharded(checkpoint_dir, "
            f"model, optimizer) (torch.distributed.checkpoint, each rank writes its shards)."
        )


# --- digest -------------------------------------------------------------------------------

def _feed(h, obj) -> None:
    """Hash ``obj`` by value: structure, order, dtypes, shapes and every byte of every tensor."""
    if torch.is_tensor(obj):
        t = obj.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}|".encode())
        h.update(ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()) if t.numel() else b"")
    elif isinstance(obj, dict):
        h.update(f"D{len(obj)}|".encode())
        for k, v in obj.items():
            _feed(h, k)
            _feed(h, v)
    elif isinstance(obj, (list, tuple)):
        h.update(f"{'L' if isinstance(obj, list) else 'U'}{len(obj)}|".encode())
        for v in obj:
            _feed(h, v)
    elif isinstance(obj, float):
        h.update(f"F{obj.hex()}|".encode())
    else:
        h.update(f"{type(obj).__name__}:{obj!r}|".encode())


def _digest(payload: dict) -> str:
    h = hashlib.sha256()
    _feed(h, payload)
    return h.hexdigest()


# --- save -----------------------------------------------------------------------------------

_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)


def _check_extra(obj, where: str) -> None:
    """Refuse what ``torch.load(weights_only=True)`` (and so `load`) cannot read back."""
    if type(obj) in _PLAIN or type(obj) in (torch.Tensor, nn.Parameter):
        return
    if type(obj) in (dict, collections.OrderedDict):
        for k, v in obj.items():
            _check_extra(k, f"{where} key {k!r}")
            _check_extra(v, f"{where}[{k!r}]")
        return
    if type(obj) in (list, tuple):
        for i, v in enumerate(obj):
            _check_extra(v, f"{where}[{i}]")
        return
    raise TypeError(
        f"ampkit.checkpoint.save(extra=...): {where} is a {type(obj).__module__}.{type(obj).__qualname__}, which "
        f"torch.load(..., weights_only=True), and so ampkit.checkpoint.load, cannot read back; store plain "
        f"Python data, tensors, lists, tuples and dicts (here e.g. {_hint(obj)}). Nothing was written."
    )


def _hint(obj) -> str:
    if isinstance(obj, os.PathLike):
        return "str(path)"
    if isinstance(obj, argparse.Namespace):
        return "vars(args)"
    if isinstance(obj, (set, frozenset)):
        return "sorted(x)"
    if callable(getattr(obj, "item", None)):  # numpy scalars and 0-d arrays
        return "x.item()"
    return "str(x), or the fields it holds"


def save(path, model: nn.Module, optimizer: torch.optim.Optimizer, extra: Optional[dict] = None) -> None:
    """Write ``model``, ``optimizer``, their loss scalers and ``extra`` (plain data, e.g. the
    step number) to ``path`` atomically.

    ``extra`` may hold None, bools, numbers, strings, bytes, tensors, dtypes, devices and
    lists/tuples/dicts of them; anything else (a numpy scalar, a ``pathlib.Path``, an
    ``argparse.Namespace``) raises a TypeError naming the key before anything is written.
    """
    if extra is not None and type(extra) is not dict:
        raise TypeError(f"ampkit.checkpoint.save(extra=...): expected a dict or None, got {type(extra).__name__}.")
    _check_kinds("save", model, optimizer)
    optimizer = unwrap(optimizer)
    _check_extra(extra, "extra")
    _refuse_sharded(model, "save")
    run = _run_of(optimizer, "save")
    payload = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "amp": run.state_dict(),  # loss scalers, and the rounder's seed and step at O7 and O8
        "extra": {} if extra is None else extra,
        "optimizer_class": _class_name(optimizer),
    }
    blob = {"format": FORMAT, "version": VERSION, "sha256": _digest(payload), **payload}
    buf = io.BytesIO()
    torch.save(blob, buf)
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    # Same folder (so the rename is atomic), unique name, the user's umask for permissions.
    tmp = os.path.join(folder, f".{os.path.basename(path)}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "xb") as f:
            f.write(buf.getbuffer())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(folder)  # make the rename itself durable


# --- load -----------------------------------------------------------------------------------

def _read(path) -> dict:
    with open(path, "rb") as f:  # FileNotFoundError etc. propagate as they are
        data = f.read()
    where = f"ampkit.checkpoint.load({os.fspath(path)!r})"
    try:
        blob = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(
            f"{where}: the file is not a readable checkpoint ({len(data)} bytes; truncated or corrupted?): "
            f"{type(e).__name__}: {e}"
        ) from e
    if not isinstance(blob, dict) or blob.get("format") != FORMAT:
        raise CheckpointError(f"{where}: not an ampkit checkpoint (no {FORMAT!r} header); write it with ampkit.checkpoint.save.")
    if blob.get("version") != VERSION:
        raise CheckpointError(f"{where}: checkpoint format version {blob.get('version')!r}; this ampkit reads version {VERSION}.")
    missing = [k for k in ("sha256", "model", "optimizer", "amp", "extra") if k not in blob]
    if missing:
        raise CheckpointError(f"{where}: the checkpoint lacks {missing}; the file is corrupted.")
    payload = {k: blob[k] for k in ("model", "optimizer", "amp", "extra", "optimizer_class") if k in blob}
    if _digest(payload) != blob["sha256"]:
        raise CheckpointError(f"{where}: SHA-256 mismatch: the file's contents are corrupted (or were edited after saving).")
    return payload


def _check_model(where, model: nn.Module, sd) -> None:
    if not isinstance(sd, dict):
        raise CheckpointError(f"{where}: 'model' is a {type(sd).__name__}, expected a state dict.")
    own = nn.Module.state_dict(model, keep_vars=True)
    missing = [k for k in own if k not in sd]
    unexpected = [k for k in sd if k not in own]
    if missing or unexpected:
        raise CheckpointError(
            f"{where}: the model state dict does not fit {type(model).__name__}: "
            f"missing keys {missing}, unexpected keys {unexpected}."
        )
    for k, mine in own.items():
        value = sd[k]
        if not torch.is_tensor(value):
            raise CheckpointError(f"{where}: model[{k!r}] is a {type(value).__name__}, expected a tensor.")
        if torch.is_tensor(mine):
            if tuple(value.shape) != tuple(mine.shape):
                raise CheckpointError(f"{where}: model[{k!r}] has shape {tuple(value.shape)}, the model has {tuple(mine.shape)}.")
            if value.is_floating_point() != mine.is_floating_point():
                raise CheckpointError(f"{where}: model[{k!r}] is {value.dtype}, the model holds {mine.dtype}.")


def _class_name(optimizer) -> str:
    return f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"


def _check_optimizer_class(where, optimizer, saved_class, osd) -> None:
    """Refuse state written by another optimizer class (its hyper-parameters would replace these)."""
    mine = _class_name(optimizer)
    if saved_class is not None and saved_class != mine:
        raise CheckpointError(f"{where}: the checkpoint's optimizer state was written by {saved_class}; this optimizer "
                              f"is {mine}. Create the optimizer the run was saved with, then load.")
    saved_keys = sorted({k for g in osd["param_groups"] if isinstance(g, dict) for k in g} - {"params"})
    my_keys = sorted({k for g in optimizer.param_groups for k in g} - {"params"})
    if saved_class is None and saved_keys != my_keys:
        raise CheckpointError(f"{where}: the checkpoint's optimizer state has the hyper-parameters {saved_keys}; this "
                              f"{mine} has {my_keys}: it was written by another optimizer class.")


def _check_optimizer(where, optimizer, osd, saved_class=None) -> None:
    if not isinstance(osd, dict) or not isinstance(osd.get("state"), dict) or not isinstance(osd.get("param_groups"), list):
        raise CheckpointError(f"{where}: 'optimizer' is not an optimizer state dict (needs 'state' and 'param_groups').")
    _check_optimizer_class(where, optimizer, saved_class, osd)
    groups = optimizer.param_groups
    if len(osd["param_groups"]) != len(groups):
        raise CheckpointError(f"{where}: the optimizer state has {len(osd['param_groups'])} param group(s), the optimizer {len(groups)}.")
    params = []
    for i, (saved, mine) in enumerate(zip(osd["param_groups"], groups)):
        ids = saved.get("params") if isinstance(saved, dict) else None
        if not isinstance(ids, list) or len(ids) != len(mine["params"]):
            n = len(ids) if isinstance(ids, list) else "no"
            raise CheckpointError(f"{where}: optimizer param group {i} holds {n} parameter(s), the optimizer's {len(mine['params'])}.")
        params.extend(zip(ids, mine["params"]))
    by_id = dict(params)
    for pid, st in osd["state"].items():
        if pid not in by_id or not isinstance(st, dict):
            raise CheckpointError(f"{where}: optimizer state for unknown parameter {pid!r}.")
        p = by_id[pid]
        for name, value in st.items():
            if torch.is_tensor(value) and value.numel() > 1 and tuple(value.shape) != tuple(p.shape):
                raise CheckpointError(
                    f"{where}: optimizer state[{pid}][{name!r}] has shape {tuple(value.shape)}, its parameter {tuple(p.shape)}."
                )


def _check_amp(where, scalers, amp) -> None:
    expected = [f"loss_scaler{i}" for i in range(len(scalers))]
    if isinstance(amp, dict) and ROUNDING in amp:
        try:
            StochasticRounder.check_state(ROUNDING, amp[ROUNDING])
        except ValueError as e:
            raise CheckpointError(f"{where}: {e}") from e
        amp = {k: v for k, v in amp.items() if k != ROUNDING}
    if not isinstance(amp, dict) or set(amp) != set(expected):
        keys = sorted(map(str, amp)) if isinstance(amp, dict) else type(amp).__name__
        raise CheckpointError(
            f"{where}: the checkpoint holds loss scalers {keys}, but initialize was called with num_losses={len(scalers)}."
        )
    for key in expected:
        try:
            LossScaler.check_state(key, amp[key])
        except ValueError as e:
            raise CheckpointError(f"{where}: {e}") from e
        streak = amp[key].get("consecutive_overflows", 0)
        if isinstance(streak, bool) or not isinstance(streak, int) or streak < 0:
            raise CheckpointError(f"{where}: {key}['consecutive_overflows']={streak!r}: expected a non-negative integer.")


def load(path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Restore ``model``, ``optimizer`` and their loss scalers from ``path``; return ``extra``.

    Everything is read and checked before anything is changed; on any error nothing is.
    """
    where = f"ampkit.checkpoint.load({os.fspath(path)!r})"
    _check_kinds("load", model, optimizer)
    optimizer = unwrap(optimizer)
    _refuse_sharded(model, "load")
    run = _run_of(optimizer, "load")
    scalers = run.scalers
    payload = _read(path)
    _check_model(where, model, payload["model"])
    _check_optimizer(where, optimizer, payload["optimizer"], payload.get("optimizer_class"))
    _check_amp(where, scalers, payload["amp"])

    undo_model = {k: v.detach().clone() for k, v in model.state_dict().items()}
    undo_opt = copy.deepcopy(optimizer.state_dict())
    undo_amp = [dict(s.state_dict()) for s in scalers]
    rounder = run.rounder
    undo_rounding = rounder.state_dict() if rounder is not None else None
    try:
        model.load_state_dict(payload["model"])
        optimizer.load_state_dict(payload["optimizer"])
        for i, s in enumerate(scalers):
            s.load_state_dict(payload["amp"][f"loss_scaler{i}"])
        if rounder is not None and ROUNDING in payload["amp"]:
            rounder.load_state_dict(payload["amp"][ROUNDING])
    except BaseException as e:  # KeyboardInterrupt too: roll back, then let it propagate
        try:
            model.load_state_dict(undo_model)
            optimizer.load_state_dict(undo_opt)
            for s, st in zip(scalers, undo_amp):
                s.load_state_dict(st)
            if rounder is not None:
                rounder.load_state_dict(undo_rounding)
        except Exception as again:
            raise CheckpointError(
                f"{where}: applying the checkpoint failed ({type(e).__name__}: {e}) and so did restoring the "
                f"previous state ({type(again).__name__}: {again}); the model and optimizer are inconsistent: "
                f"load a checkpoint again before training."
            ) from e
        if not isinstance(e, Exception):
            raise
        raise CheckpointError(f"{where}: applying the checkpoint failed, nothing was changed: {type(e).__name__}: {e}") from e
    return payload["extra"]
