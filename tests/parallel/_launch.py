"""Run a function on N local worker processes joined by a gloo process group, with bounds.

``run(fn, n, *args)`` spawns ``n`` processes; rank ``r`` calls ``fn(r, n, *args)`` inside
an initialized gloo process group (file rendezvous, so no port can be taken by someone
else) and its return value comes back through ``torch.save``. Nothing hangs: the
process group has a timeout, and workers still alive at the deadline are killed. Both are
generous (minutes): they end a hung run and never decide a verdict on a slow machine.
"""
import datetime
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from multiprocessing import get_context
from pathlib import Path

import torch
import torch.distributed as dist


class WorkerError(AssertionError):
    """A worker raised, died or hung; the message holds every rank's outcome."""


def _worker(fn, rank, world_size, tmp, pg_timeout, args):
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout),
        )
        outcome = {"ok": True, "value": fn(rank, world_size, *args)}
    except BaseException as e:  # reported to the parent, never swallowed
        outcome = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    outcome["exit_time"] = time.time()
    torch.save(outcome, f"{tmp}/{rank}.pt")
    if outcome["ok"]:
        dist.destroy_process_group()
    os._exit(0 if outcome["ok"] else 1)  # a failed rank leaves at once; its peers see it go


def launch(fn, world_size, *args, timeout=600.0, pg_timeout=300.0):
    """Every rank's outcome: ``{"ok", "value" | "error", "traceback", "exit_time"}``, or ``{"ok": False, "error": "hung"/"died"}``."""
    ctx = get_context("spawn")
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    with tempfile.TemporaryDirectory() as tmp:
        try:
            procs = [ctx.Process(target=_worker, args=(fn, r, world_size, tmp, pg_timeout, args)) for r in range(world_size)]
            for p in procs:
                p.start()
        finally:
            if saved is None:
                del os.environ["OMP_NUM_THREADS"]
            else:
                os.environ["OMP_NUM_THREADS"] = saved
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        outcomes = []
        for r, p in enumerate(procs):
            hung = p.is_alive()
            if hung:
                p.kill()
                p.join()
            path = f"{tmp}/{r}.pt"
            if os.path.exists(path):
                outcomes.append(torch.load(path, weights_only=False))
            else:
                outcomes.append({"ok": False, "error": "hung" if hung else f"died (exit code {p.exitcode})"})
    return outcomes


def run(fn, world_size, *args, timeout=600.0, pg_timeout=300.0):
    """Every rank's return value; raise :class:`WorkerError` if any rank failed."""
    outcomes = launch(fn, world_size, *args, timeout=timeout, pg_timeout=pg_timeout)
    if not all(o["ok"] for o in outcomes):
        raise WorkerError("\n".join(f"rank {r}: {o.get('traceback') or o['error']}" for r, o in enumerate(outcomes)))
    return [o["value"] for o in outcomes]


ROOT = Path(__file__).resolve().parents[2]


def torchrun_example(script, *args, nproc=2):
    """Run ``examples/<script>`` under torchrun (``python -m torch.distributed.run``) on
    ``nproc`` CPU processes; return its output, or fail with it when it exits non-zero. The
    deadline only ends a hung run."""
    path = [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(path))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           str(ROOT / "examples" / script), *map(str, args)]
    # A session of its own, so that the hang guard takes torchrun's workers down with it.
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, output
    return output


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (another process may take it before it is used)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_nodes(script, *args, nnodes=2, nproc=2):
    """Run ``examples/<script>`` as ``nnodes`` torchrun launchers on this machine, each with
    ``--nnodes nnodes --nproc-per-node nproc`` and a c10d rendezvous on 127.0.0.1 (as on
    ``nnodes`` machines); return each launcher's output, or fail with them when one exits
    non-zero."""
    path = [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(path))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--nproc-per-node", str(nproc),
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "ampkit-test",
           "--local-addr", "127.0.0.1", str(ROOT / "examples" / script), *map(str, args)]
    procs = [subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True) for _ in range(nnodes)]
    outputs = []
    try:
        deadline = time.monotonic() + 600
        for proc in procs:
            outputs.append(proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    assert all(p.returncode == 0 for p in procs), "\n----\n".join(outputs)
    return outputs
