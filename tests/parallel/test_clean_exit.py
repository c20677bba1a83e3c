"""Jobs on ampkit's DDP and FSDP2 exit cleanly under torchrun (pytorch/pytorch#190489): every
launch of a small 2-rank job (``_exit_job.py``) exits 0 and no output has an abort.
``benchmarks/exit_soak.py`` runs 50 launches of each under load."""
import atexit
import os
import subprocess
import sys

import pytest

from ampkit.parallel import clean_exit

from ._launch import ROOT

JOB = ROOT / "tests" / "parallel" / "_exit_job.py"


def torchrun_job(kind: str, tmp_path) -> subprocess.CompletedProcess:
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(JOB), kind,
           str(tmp_path / "checkpoint")]
    return subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path), cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("kind, launches", [("ddp", 6), ("fsdp", 5)])
def test_every_launch_exits_cleanly(kind, launches, tmp_path):
    for i in range(launches):
        proc = torchrun_job(kind, tmp_path / str(i))
        output = proc.stdout + proc.stderr
        assert proc.returncode == 0 and "terminate called" not in output, f"launch {i + 1}: {output}"
        assert output.count(f"{kind} done") == 2


def test_the_exit_handler_is_registered_once(monkeypatch):
    registered = []
    monkeypatch.setattr(clean_exit, "_state", {"registered": False})
    monkeypatch.setattr(atexit, "register", registered.append)
    clean_exit.guard_exit()
    clean_exit.guard_exit()
    assert registered == [clean_exit._wait_for_workers]
