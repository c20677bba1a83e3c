"""examples/distributed/train.py under torchrun (``python -m torch.distributed.run``): 2 CPU processes."""
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.repo_files("examples")]  # real processes

ROOT = Path(__file__).resolve().parents[2]


def test_example_trains_under_torchrun():
    path = [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(path))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "examples" / "distributed" / "train.py"), "--opt-level", "O5", "--steps", "3", "--batch-size", "4"]
    # A session of its own, so that a timeout takes torchrun's workers down with it.
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, output
    assert "step    2  loss" in output
    assert "parameters identical on all 2 ranks: True" in output
