from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request):
    return torch.device(request.param)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _one_thread():
    """One CPU thread per test: tiny tensors gain nothing from a second OpenMP thread on a shared
    machine, and a fixed thread count keeps bit-for-bit comparisons independent of the host."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def pytest_runtest_setup(item):
    """``@pytest.mark.repo_files("examples", ...)``: skip, with the reason, when the tests run
    from outside a checkout (say, against an installed wheel) and those files are absent."""
    for mark in item.iter_markers("repo_files"):
        missing = [p for p in mark.args if not (REPO / p).exists()]
        if missing:
            pytest.skip(f"needs the repository's {', '.join(missing)} (absent next to these tests: {REPO})")
