"""The exit handler of jobs on ampkit's DDP and FSDP2 (pytorch/pytorch#190489): registered once, waits
until gloo's workers sleep. Whether launches then exit cleanly is a rate, not a verdict one run can
give: ``benchmarks/exit_soak.py`` counts it over 50 torchrun launches under load."""
import atexit
import os

import pytest

from ampkit._parallel import clean_exit

from ._launch import run


def test_the_exit_handler_is_registered_once(monkeypatch):
    registered = []
    monkeypatch.setattr(clean_exit, "_state", {"registered": False})
    monkeypatch.setattr(atexit, "register", registered.append)
    clean_exit.guard_exit()
    clean_exit.guard_exit()
    assert registered == [clean_exit._wait_for_workers]


class Clock:
    """``time.sleep`` and ``time.monotonic`` for the handler: sleeping advances the clock, nothing waits."""

    def __init__(self, monkeypatch):
        self.now, self.sleeps = 0.0, 0
        monkeypatch.setattr(clean_exit.time, "sleep", self.sleep)
        monkeypatch.setattr(clean_exit.time, "monotonic", lambda: self.now)

    def sleep(self, seconds):
        self.now += seconds
        self.sleeps += 1


@pytest.mark.parametrize("seen, polls", [
    ([None], 1),  # no /proc: one poll
    ([[]], 2),  # no gloo workers: two polls
    ([[("R", "3", "1")], [("S", "4", "1")], [("S", "4", "1")]], 3),  # running, then asleep for a poll
    ([[("S", "4", "1")], [("S", "5", "1")], [("S", "5", "1")]], 3),  # woke between two polls
])
def test_the_exit_handler_waits_until_the_workers_sleep(monkeypatch, seen, polls):
    clock, left = Clock(monkeypatch), list(seen)
    monkeypatch.setattr(clean_exit, "_workers", lambda: left.pop(0) if len(left) > 1 else left[0])
    clean_exit._wait_for_workers()
    assert clock.sleeps == polls


def test_the_exit_handler_gives_up_on_busy_workers(monkeypatch):
    clock, polls = Clock(monkeypatch), iter(range(10**6))
    monkeypatch.setattr(clean_exit, "_workers", lambda: [("R", str(next(polls)), "0")])
    clean_exit._wait_for_workers()
    assert clock.now >= clean_exit.MAX_WAIT_S and clock.sleeps == round(clean_exit.MAX_WAIT_S / clean_exit.POLL_S)


def _workers_after_a_collective(rank, world_size):
    import torch
    import torch.distributed as dist

    dist.all_reduce(torch.ones(3))
    return clean_exit._workers()


@pytest.mark.slow
def test_the_gloo_workers_are_found_in_proc():
    if not os.path.isdir("/proc/self/task"):
        pytest.skip("no /proc here: the handler waits one poll")
    for workers in run(_workers_after_a_collective, 2):
        assert workers and all(state.isalpha() and switches.isdigit() for state, switches, _ in workers)
