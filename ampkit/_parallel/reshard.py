"""What a sharded checkpoint records about the run that wrote it, and how its per-shard
parts are laid out again in a run of another size, level or mesh.

Model and optimizer state are DTensors (float32 at every level: masters, widened weights,
widened 8-bit state), which ``torch.distributed.checkpoint`` reshards by itself. What it
cannot reshard is ampkit's own: the loss scalers and the O7/O8 rounding state, plain values
the same on every rank (the rounding state is seed and step, the same on every shard, so any
shard layout continues exactly). Here:

* `describe` names the run's level and its number of shards (saved as ``"run"``);
* `saved_template` rebuilds the checkpoint's ``"amp"`` entry from its metadata, so the
  keys loaded are those saved (another level has other keys: O5 has no rounding state);
* `writing` and `check_complete` mark a checkpoint as incomplete while it is written.
"""
import contextlib
import os
from typing import Optional

import torch
import torch.distributed as dist

from .._common.files import fsync_dir
from .._config.levels import REMAINDER, UpdateKind

INCOMPLETE = ".ampkit-incomplete"  # present while save_sharded writes the directory


def describe(props, shards: int) -> dict:
    """The ``"run"`` entry of a sharded checkpoint: the level as ``initialize`` set it up, and
    how many shards (ranks along the sharding dimension) wrote it."""
    return {"level": level_name(props), "shards": shards}


def level_name(props) -> str:
    """``"O5"``, or ``"O5 (master_weights='remainder')"`` where an option changed what is stored."""
    extra = []
    if props.update is UpdateKind.REMAINDER:
        extra.append(f"master_weights={REMAINDER!r}")
    dtype = props.optimizer_state_dtype
    if dtype is not None and props.opt_level != "O8":
        extra.append(f"optimizer_state_dtype={dtype!r}")
    return f"{props.opt_level} ({', '.join(extra)})" if extra else props.opt_level


def local_dir(checkpoint_id) -> Optional[str]:
    """``checkpoint_id`` as a local directory path; None for a storage object or a URL
    (``s3://...``: DCP writes those through fsspec, and ampkit leaves them to it)."""
    if not isinstance(checkpoint_id, (str, os.PathLike)) or "://" in os.fspath(checkpoint_id):
        return None
    return os.fspath(checkpoint_id)


def saved_metadata(checkpoint_id):
    """The checkpoint's DCP metadata, or None where ``checkpoint_id`` is not a local directory that holds one."""
    path = local_dir(checkpoint_id)
    if path is None or not os.path.isfile(os.path.join(path, ".metadata")):
        return None
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(path).read_metadata()


def saved_template(metadata, top: str) -> Optional[dict]:
    """The nested dict saved under ``top`` (e.g. ``"amp"``) with placeholders DCP loads into: a
    plain tensor of the saved global shape (every rank reads it whole) or None for a value;
    None when nothing was saved under ``top``."""
    out = None
    for key, path in (metadata.planner_data or {}).items():
        if not path or path[0] != top:
            continue
        out = {} if out is None else out
        node = out
        for name in path[1:-1]:
            node = node.setdefault(name, {})
        entry = metadata.state_dict_metadata[key]
        size = getattr(entry, "size", None)
        node[path[-1]] = None if size is None else torch.empty(size, dtype=entry.properties.dtype)
    return out


@contextlib.contextmanager
def writing(checkpoint_id):
    """Around a collective ``dcp.save`` into directory ``checkpoint_id``: the first rank marks
    it incomplete before any rank writes, and clears the mark once every rank has finished. A
    rank that dies in between leaves the mark, which `check_complete` refuses."""
    path = local_dir(checkpoint_id)
    if path is None:
        yield
        return
    marker = os.path.join(path, INCOMPLETE)
    first = dist.get_rank() == 0
    if first:
        os.makedirs(path, exist_ok=True)
        with open(marker, "w") as f:
            f.write(f"ampkit.parallel.save_sharded by {dist.get_world_size()} ranks: started, not finished\n")
            f.flush()
            os.fsync(f.fileno())
    dist.barrier()
    yield
    dist.barrier()
    if first:
        os.unlink(marker)
        fsync_dir(path)


def check_complete(checkpoint_id) -> None:
    """Refuse a directory that `writing` left marked: save_sharded did not finish it."""
    path = local_dir(checkpoint_id)
    if path is not None and os.path.exists(os.path.join(path, INCOMPLETE)):
        raise ValueError(
            f"ampkit.parallel.load_sharded({path!r}): the checkpoint is incomplete: "
            f"save_sharded started writing it but did not finish (a rank failed or was killed mid-save), so "
            f"some shards are missing or stale. Nothing was loaded; load an earlier checkpoint."
        )
