"""ampkit's logger: the library decides what it says, the application where it goes.

``logging.getLogger("ampkit")`` carries one handler, `_LastResortIfUnconfigured`,
a ``NullHandler`` that adds no output of its own once the application has configured
logging. Its level is never set and no stream handler is added, so ``logging.basicConfig``
(or any handler on ``"ampkit"`` or the root) fully decides what is shown. In a script that
configured nothing, warnings still reach stderr through ``logging.lastResort``, exactly as
they would for a logger without handlers; `enable_console_logging` opts in to the
INFO messages (the ``initialize`` banner, skipped steps) without configuring anything else.
"""
import logging
import sys

import torch

logger = logging.getLogger("ampkit")


class _LastResortIfUnconfigured(logging.NullHandler):
    """Silent, except that with no other handler on the way to the root a record goes to
    ``logging.lastResort`` (WARNING and above), as it would without this handler."""

    def handle(self, record):
        node = logger
        while node is not None:
            if any(h is not self for h in node.handlers):
                return False
            node = node.parent if node.propagate else None
        last = logging.lastResort
        if last is not None and record.levelno >= last.level:
            last.handle(record)
        return False


if not any(isinstance(h, _LastResortIfUnconfigured) for h in logger.handlers):
    logger.addHandler(_LastResortIfUnconfigured())

_console = None


def enable_console_logging(level: int = logging.INFO, stream=None) -> logging.Handler:
    """Print ampkit's messages at ``level`` and above to ``stream`` (stderr by default).

    For scripts that do not configure ``logging`` themselves. Calling it again replaces the
    previous console handler. Returns the handler (``logger.removeHandler`` undoes it).
    """
    global _console
    if _console is not None:
        logger.removeHandler(_console)
    _console = logging.StreamHandler(stream if stream is not None else sys.stderr)
    _console.setLevel(level)
    _console.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(_console)
    if logger.getEffectiveLevel() > level:
        logger.setLevel(level)  # the user asked for this level: let records through
    return _console


def is_main_process() -> bool:
    """Rank 0 of the default process group, or a single process."""
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
