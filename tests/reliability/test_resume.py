"""Resume without loss: SIGKILL a training subprocess at a random step after it wrote a
checkpoint, resume from that checkpoint, and match an uninterrupted run bit for bit."""
import copy
import os
import random
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import ampkit
from ampkit import checkpoint

from . import _resume_worker as worker
from ._harness import raw

pytestmark = pytest.mark.slow  # real processes

WORKER = Path(worker.__file__).resolve()
REPO = Path(ampkit.__file__).resolve().parent.parent
TOTAL, EVERY = 40, 6


class _spawn(subprocess.Popen):
    """The worker as a context manager that never outlives the test."""

    def __init__(self, *args):
        env = dict(os.environ, OMP_NUM_THREADS="1")
        env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        super().__init__([sys.executable, str(WORKER), *map(str, args)], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, env=env)
        self.watchdog = threading.Timer(120, self.kill)  # a hung worker cannot hang the suite
        self.watchdog.start()

    def __exit__(self, *exc):
        self.watchdog.cancel()
        if self.poll() is None:
            self.send_signal(signal.SIGKILL)
        return super().__exit__(*exc)


def _run_until(proc, stop_at=None):
    """Read the worker's lines; SIGKILL it right after it reports step ``stop_at``."""
    steps, ckpts, other = [], [], []
    for line in proc.stdout:
        word, _, n = line.strip().partition(" ")
        if word == "CKPT":
            ckpts.append(int(n))
        elif word == "STEP":
            steps.append(int(n))
            if int(n) == stop_at:
                break
        elif word == "DONE":
            break
        else:
            other.append(line)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=600)
    rest = proc.stdout.readlines()  # printed before the signal landed
    late = [int(line.split()[1]) for line in rest if line.startswith("CKPT ")]
    other += [line for line in rest if not line.startswith(("CKPT ", "STEP ", "DONE"))]
    assert proc.returncode == -signal.SIGKILL, f"worker exited with {proc.returncode}:\n{''.join(other)}"
    return steps, ckpts + late


def _state(model, opt):
    return {
        "params": [raw(p) for p in model.parameters()],
        "masters": [raw(p) for p in ampkit.master_params(opt)],
        "model": {k: raw(v) for k, v in model.state_dict().items()},
        "opt": _rawtree(opt.state_dict()),
        "amp": [s.state_dict() for s in opt._ampkit.run.scalers],
    }


def _rawtree(obj):
    if torch.is_tensor(obj):
        return raw(obj)
    if isinstance(obj, dict):
        return {k: _rawtree(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_rawtree(v) for v in obj)
    return obj


def _same(a, b, path="state"):
    if isinstance(a, tuple) and len(a) == 4 and isinstance(a[0], torch.dtype):
        assert a[:3] == b[:3] and torch.equal(a[3], b[3]), f"{path} differs"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{path} keys differ"
        for k in a:
            _same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path} length differs"
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def _reference(level):
    model, opt, poison = worker.build(level)
    at = {}
    losses = worker.train(model, opt, poison, 0, TOTAL,
                          on_step=lambda s: at.__setitem__(s, copy.deepcopy(_state(model, opt))) if s % EVERY == 0 else None)
    return losses, at, _state(model, opt)


def _resume_and_compare(level, ckpt, ref_losses, ref_at, ref_final, why):
    model, opt, poison = worker.build(level)
    extra = checkpoint.load(ckpt, model, opt)
    c = extra["step"]
    assert EVERY <= c < TOTAL and c % EVERY == 0, why
    _same(ref_at[c], _state(model, opt), f"{why}: state loaded at step {c}")
    losses = worker.train(model, opt, poison, c, TOTAL)
    assert losses == ref_losses[c:], f"{why}: per-step losses after step {c}"
    _same(ref_final, _state(model, opt), f"{why}: final state")
    return c


@pytest.mark.parametrize("level", ["O0", "O2", "O5", "O8"])
def test_sigkill_at_a_random_step_then_resume_is_bit_exact(level, tmp_path):
    seed = random.SystemRandom().randrange(2**32)
    stop_at = random.Random(seed).randint(EVERY + 1, TOTAL - 1)
    why = f"{level}, kill after step {stop_at} (seed {seed})"
    ckpt = tmp_path / "run.ckpt"
    with _spawn("--level", level, "--ckpt", ckpt, "--total", TOTAL, "--every", EVERY) as proc:
        ref_losses, ref_at, ref_final = _reference(level)  # computed while the worker runs
        steps, ckpts = _run_until(proc, stop_at)
    assert len(ref_losses) == TOTAL and len(set(ref_losses)) > TOTAL // 2
    if level == "O2":  # the scale moved both ways: the scaler's state is part of what resumes
        scales = [st["amp"][0]["loss_scale"] for st in ref_at.values()]
        assert len(set(scales)) > 1, scales
    assert steps[-1] == stop_at and ckpts, why
    c = _resume_and_compare(level, ckpt, ref_losses, ref_at, ref_final, why)
    # the newest complete checkpoint (one finished just as the signal landed may be unreported)
    assert c >= max(ckpts), why


def test_sigkill_inside_a_save_keeps_the_previous_checkpoint(tmp_path):
    """Killed after the new checkpoint's temporary file is written but before it replaces
    the old one: the file on disk is still the previous complete checkpoint."""
    ckpt = tmp_path / "run.ckpt"
    with _spawn("--level", "O2", "--ckpt", ckpt, "--total", TOTAL, "--every", EVERY, "--die-in-save-at", 3 * EVERY) as proc:
        ref = _reference("O2")
        steps, ckpts = _run_until(proc)
    assert ckpts == [EVERY, 2 * EVERY] and steps[-1] == 3 * EVERY - 1
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != ckpt.name]
    assert len(leftovers) == 1 and leftovers[0].endswith(".tmp")  # the unfinished new checkpoint
    assert _resume_and_compare("O2", ckpt, *ref, "killed inside save") == 2 * EVERY
