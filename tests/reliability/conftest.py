"""Reliability suite plumbing: one CPU thread per test, and the bad-input count."""
import pytest
import torch

_BAD = {"passed": 0, "failed": 0}


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny tensors: a second OpenMP thread only adds contention on a shared machine, and a
    # fixed thread count keeps the bit-for-bit comparisons independent of the host.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def pytest_runtest_logreport(report):
    if "test_bad_inputs.py::test_bad_input[" not in report.nodeid:
        return
    if report.when == "call" or (report.when == "setup" and not report.passed):
        _BAD["passed" if report.passed else "failed"] += 1


def pytest_terminal_summary(terminalreporter):
    total = _BAD["passed"] + _BAD["failed"]
    if total:
        terminalreporter.write_line(
            f"ampkit reliability: {total} bad inputs checked ({_BAD['passed']} as documented, {_BAD['failed']} not)"
        )
