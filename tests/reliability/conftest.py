"""Reliability suite plumbing: the bad-input count."""

_BAD = {"passed": 0, "failed": 0}


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
