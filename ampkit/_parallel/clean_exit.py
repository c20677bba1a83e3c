"""A clean interpreter exit for jobs on torch.distributed (pytorch/pytorch#190489).

With CPython 3.11, a job that finishes, destroys its process group and exits can die with
``terminate called without an active exception`` (SIGABRT): a gloo worker thread, which DDP
and FSDP keep alive past ``destroy_process_group``, drops the last reference to a finished
collective's work while the main thread finalizes; releasing the work's tensors takes the GIL,
and CPython ends a thread that takes it during finalization with a forced unwind through a
noexcept destructor. `guard_exit` registers one ``atexit`` handler that frees what still
holds such work (DDP's reducer and FSDP's state sit in reference cycles), then waits, with the
GIL released, until gloo's worker threads are idle, so they finish their releases before
finalization begins.
"""
import atexit
import gc
import os
import time
from typing import Optional

from .._common.logs import logger

__all__ = ["guard_exit"]

WORKERS = "pt_gloo_runloop"  # the name torch gives gloo's worker threads
POLL_S = 0.05  # the wait is at least two polls; a fixed 0.05 s took 12 aborts in 45 launches to 0 in 25
MAX_WAIT_S = 2.0
_state = {"registered": False}


def guard_exit() -> None:
    """Once per process (DDP and FSDP2 wraps call it): wait for gloo's workers at interpreter exit.

    ``atexit`` runs its handlers last registered, first run: this one runs after the
    handlers the script registers from here on (a ``destroy_process_group`` among them)."""
    if not _state["registered"]:
        _state["registered"] = True
        atexit.register(_wait_for_workers)


def _workers() -> Optional[list]:
    """(state, context switches) of each gloo worker thread (Linux's /proc), or ``None`` where unknown."""
    try:
        tids = sorted(os.listdir("/proc/self/task"))
    except OSError:
        return None
    statuses = [_status(tid) for tid in tids]
    return [(s["State"].split()[0], s["voluntary_ctxt_switches"], s["nonvoluntary_ctxt_switches"])
            for s in statuses if s.get("Name") == WORKERS]


def _status(tid: str) -> dict:
    """A thread's ``/proc`` status fields (none if it has ended)."""
    try:
        with open(f"/proc/self/task/{tid}/status") as f:
            return {k: v.strip() for k, v in (line.split(":", 1) for line in f.read().splitlines() if ":" in line)}
    except OSError:
        return {}


def _wait_for_workers() -> None:
    """Collect cycles, then sleep (the GIL released) until gloo's workers sleep and have not
    woken for a poll (or ``MAX_WAIT_S`` passed; without /proc, one poll)."""
    gc.collect()
    deadline, before = time.monotonic() + MAX_WAIT_S, None
    while time.monotonic() < deadline:
        time.sleep(POLL_S)
        now = _workers()
        if now is None or (now == before and all(state == "S" for state, *_ in now)):
            return
        before = now
    logger.debug("ampkit: gloo's worker threads still busy after %.1f s at exit (pytorch/pytorch#190489).", MAX_WAIT_S)
