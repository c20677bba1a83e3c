"""Clean exit under torchrun, under load: many launches of a small 2-rank gloo job, counted.

    python benchmarks/exit_soak.py [--quick] [--launches 50] [--jobs ddp,fsdp] [--burners 1] [--json PATH]

Each launch runs ``benchmarks/exit_job.py`` (DDP at O1, or FSDP2 at O5 with a sharded save, then print and
``destroy_process_group``) under ``torchrun --standalone --nproc_per_node 2``, while
``--burners`` processes spin on the CPUs. A launch fails when torchrun exits non-zero; an abort
is a failed launch whose output has ``terminate called`` (pytorch/pytorch#190489, what
``ampkit/_parallel/clean_exit.py`` works around). Target: 0 failed launches of 50, each job.
The JSON keeps the end of each failed launch's output. ``--quick`` runs 3 launches of each to
check that everything runs.
"""
import argparse
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Log, finish, table  # noqa: E402

from ampkit._cli.demo import machine  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(ROOT, "benchmarks", "exit_job.py")


def burn() -> None:
    while True:
        pass


def launch(kind: str) -> dict:
    """One torchrun launch of the job: its exit code and whether its output has an abort."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", JOB, kind,
               os.path.join(tmp, "checkpoint")]
        proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    return {"rc": proc.returncode, "abort": "terminate called" in output, "tail": output[-3000:] if proc.returncode else ""}


def soak(kind: str, launches: int, log: Log) -> dict:
    started, outcomes = time.perf_counter(), []
    for i in range(launches):
        outcomes.append(launch(kind))
        log(kind, f"launch {i + 1}/{launches}: exit code {outcomes[-1]['rc']}" + (", abort" if outcomes[-1]["abort"] else ""))
    return {"job": kind, "launches": launches, "failed": sum(o["rc"] != 0 for o in outcomes),
            "aborts": sum(o["abort"] for o in outcomes), "wall_s": time.perf_counter() - started,
            "failures": [o["tail"] for o in outcomes if o["rc"]]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--launches", type=int, default=50)
    p.add_argument("--jobs", default="ddp,fsdp")
    p.add_argument("--burners", type=int, default=1, help="processes spinning on the CPU while the launches run")
    p.add_argument("--json")
    args = p.parse_args()
    launches = 3 if args.quick else args.launches
    started, info, log = time.perf_counter(), machine(torch.device("cpu")), Log("exit")
    burners = [multiprocessing.Process(target=burn, daemon=True) for _ in range(args.burners)]
    for b in burners:
        b.start()
    try:
        results = [soak(kind, launches, log) for kind in args.jobs.split(",")]
    finally:
        for b in burners:
            b.kill()
            b.join()
    text = table(results, [("job", "job", "{}"), ("launches", "launches", "{}"), ("failed", "failed", "{}"),
                           ("aborts", "aborts", "{}"), ("seconds", "wall_s", "{:.0f}")])
    targets = [{"target": f"{r['job']}: 0 failed launches of {r['launches']}", "measured": r["failed"],
                "met": r["failed"] == 0} for r in results]
    finish(f"Clean exit under torchrun ({args.burners} burner(s))\n{text}", info, args, started,
           {"burners": args.burners, "jobs": results}, targets)


if __name__ == "__main__":
    main()
