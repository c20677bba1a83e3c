"""Real data for ``benchmarks/families/convergence.py``, read from files a Debian package installs;
nothing is downloaded.

* Fashion-MNIST (Zalando, MIT licence; ``apt-get install dataset-fashion-mnist``: the four IDX files,
  gzipped, 30 MB, under ``/usr/share/datasets/fashion-mnist/``), read by :func:`read_idx`.
* English text (BSD licence; ``apt-get install fortunes``: 2.6 MB of plain files under
  ``/usr/share/games/fortunes/``), read as bytes by :func:`text_files` and cut by position into a
  training and a held-out part of every file (:func:`split_text`).
"""
import gzip
import struct
from pathlib import Path

import numpy as np
import torch

FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")
FORTUNES = Path("/usr/share/games/fortunes")
INSTALL = {"fashion-mnist": "apt-get install dataset-fashion-mnist", "text": "apt-get install fortunes"}
IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}  # big-endian
MEAN, STD = 0.2860, 0.3530  # Fashion-MNIST's training pixels, scaled to [0, 1]


class MissingData(FileNotFoundError):
    """A data set is not installed; the message says how to install it."""


def missing(what: str, folder: Path) -> MissingData:
    return MissingData(f"{what} not found under {folder}: install it with `{INSTALL[what]}` (Debian, as root), "
                       f"or name another folder")


def read_idx(path) -> torch.Tensor:
    """An IDX file (``.gz`` or plain): two zero bytes, the element type, the number of dimensions,
    one big-endian 32-bit size per dimension, then the elements in big-endian order."""
    path = Path(path)
    with (gzip.open if path.suffix == ".gz" else open)(path, "rb") as f:
        raw = f.read()
    zero, kind, ndim = struct.unpack_from(">HBB", raw)
    if zero != 0 or kind not in IDX_DTYPES:
        raise ValueError(f"{path}: not an IDX file (magic {raw[:4].hex()})")
    shape = struct.unpack_from(f">{ndim}I", raw, 4)
    dtype = np.dtype(IDX_DTYPES[kind])
    count = int(np.prod(shape))
    if len(raw) - 4 - 4 * ndim != count * dtype.itemsize:
        raise ValueError(f"{path}: {len(raw) - 4 - 4 * ndim} bytes of data for shape {shape}")
    values = np.frombuffer(raw, dtype, count, offset=4 + 4 * ndim)
    return torch.from_numpy(values.astype(dtype.newbyteorder("="))).reshape(shape)


def fashion_mnist(folder=FASHION_MNIST) -> dict:
    """``{"train": (images, labels), "test": (images, labels)}``: images float32 (n, 1, 28, 28),
    normalized with the training set's mean and deviation; labels int64."""
    folder = Path(folder)
    out = {}
    for part, prefix in (("train", "train"), ("test", "t10k")):
        paths = [folder / f"{prefix}-{kind}-idx{dims}-ubyte.gz" for kind, dims in (("images", 3), ("labels", 1))]
        if not all(p.exists() for p in paths):
            raise missing("fashion-mnist", folder)
        images, labels = (read_idx(p) for p in paths)
        out[part] = ((images.float() / 255 - MEAN) / STD).unsqueeze(1), labels.long()
    return out


def text_files(folder=FORTUNES) -> list:
    """The bytes of every plain text file in ``folder`` (sorted by name; no links, no ``.dat`` indexes)."""
    folder = Path(folder)
    paths = sorted(p for p in folder.glob("*") if p.is_file() and not p.is_symlink() and p.suffix != ".dat")
    if not paths:
        raise missing("text", folder)
    return [p.read_bytes() for p in paths]


def split_text(files: list, held_out: float) -> tuple:
    """``(train, held_out)`` uint8 tensors: the first ``1 - held_out`` of every file's bytes, joined, and
    the rest of every file, joined; every topic is in both parts and no byte in both."""
    cuts = [round(len(f) * (1 - held_out)) for f in files]
    train = b"".join(f[:c] for f, c in zip(files, cuts))
    rest = b"".join(f[c:] for f, c in zip(files, cuts))
    return tuple(torch.frombuffer(bytearray(b), dtype=torch.uint8).clone() for b in (train, rest))
