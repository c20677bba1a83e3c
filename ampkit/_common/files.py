"""Durable writes: a rename or an unlink is on disk only once its directory is synced."""
import os

__all__ = ["fsync_dir"]


def fsync_dir(path) -> None:
    """``fsync`` the directory ``path`` (best effort: file systems that refuse it are skipped)."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass
