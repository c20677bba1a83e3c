"""examples/fsdp/train.py under torchrun (``python -m torch.distributed.run``): 2 CPU processes,
a sharded checkpoint, a resume in new processes, and a float32 export."""
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def _torchrun(*args):
    path = [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(path))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "examples" / "fsdp" / "train.py"), "--steps", "3", "--batch-size", "2", "--d-model", "32", *args]
    # A session of its own, so that a hang guard takes torchrun's workers down with it.
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


def test_example_trains_checkpoints_resumes_and_exports(tmp_path):
    first = _torchrun("--opt-level", "O5", "--checkpoint-dir", str(tmp_path / "ckpt"))
    assert "step    2  loss" in first and "saved a sharded checkpoint" in first
    second = _torchrun("--opt-level", "O5", "--checkpoint-dir", str(tmp_path / "ckpt"), "--resume",
                       "--export", str(tmp_path / "model.pt"))
    assert "step    5  loss" in second
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    assert state and all(v.dtype == torch.float32 for v in state.values())
