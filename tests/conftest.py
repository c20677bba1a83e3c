import os
import tempfile
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

# The numerics tests (``-m numerics``): their assertions rest on floating-point results (training
# trajectories, rounding, 8-bit and fp8 codes, compiled kernels), so a dependence on the CPU's SIMD
# width or on the thread count would show in them first. .ci/run runs them a second time with
# ATEN_CPU_CAPABILITY=default and one thread. Paths are relative to tests/: a folder takes all of it,
# a module all its tests, "module.py::test_name" one test (all its parameters).
NUMERICS = (
    "kernels/test_blockquant.py", "model/test_casting.py", "kernels/test_compiled_update.py", "kernels/test_compiled_sgd.py",
    "kernels/test_fused_adamw_8bit.py",
    "kernels/test_fused_masters.py", "kernels/test_fused_sgd_remainder.py", "kernels/test_sgd_8bit.py", "kernels/test_fused_sgd.py", "kernels/test_ieee.py", "kernels/test_remainder.py", "benchmarks/test_remainder_simulation.py", "kernels/test_rounding.py",
    "kernels/test_unscale.py", "run/test_scaler.py",
    "model/test_apex_lists.py", "model/test_copies.py", "loop/test_dropped_batches.py",
    "model/test_float8.py", "update/test_fused_update.py", "update/test_fused_sgd_update.py", "update/test_fused_update_8bit.py",
    "optim/test_grad_kinds.py", "optim/test_master_weights.py", "loop/test_multi_loss.py",
    "model/test_recurrent.py", "update/test_remainder_masters.py", "update/test_shared_blocks.py",
    "update/test_state_8bit.py", "update/test_rounded_update.py", "update/test_masters.py", "kernels/test_ops.py",
    "normalization/", "parallel/",
    "precision/test_ground_truth.py", "precision/test_report_api.py", "loop/test_checkpoint.py",
    "loop/test_compile.py", "apex_api/test_fp16_utils.py", "loop/test_nonfinite_gradients.py",
    "apex_compat/test_optimizers.py", "initialize/test_initialize.py::test_training_reduces_loss",
    "reliability/test_resume.py",
)


@pytest.fixture(params=DEVICES)
def device(request):
    return torch.device(request.param)


@pytest.fixture(scope="session")
def lib():
    """ampkit's C kernels (``ampkit/_kernels/native.py``), for the tests that compare them with the
    eager references; those skip where there is no C compiler (the eager path is all there is)
    and fail where there is one but the kernels do not build."""
    from ampkit._kernels import native
    built = native.library()
    if built is None and native.compiler() is None:
        pytest.skip("no C compiler here: the eager path is all there is")
    assert built is not None, "a C compiler is here but the kernels did not build (see the log line)"
    return built


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


def pytest_configure(config):
    """Inductor's compiled kernels cached per CPU capability, unless ``TORCHINDUCTOR_CACHE_DIR`` names a cache:
    inductor's keys leave ``ATEN_CPU_CAPABILITY`` out, so the numerics pass on torch's portable kernels would
    otherwise load the AVX2/AVX512 kernels an earlier run of the suite compiled, and fail to build them."""
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        capability = torch.backends.cpu.get_cpu_capability()
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tempfile.gettempdir(), f"ampkit-inductor-{capability}-{os.getuid()}")


def pytest_collection_modifyitems(config, items):
    """Mark the tests under NUMERICS with ``numerics``."""
    root = REPO / "tests"
    for item in items:
        if not item.path.is_relative_to(root):
            continue
        module = item.path.relative_to(root)
        test = item.nodeid.partition("::")[2].partition("[")[0]  # without its parameters
        names = {f"{folder.as_posix()}/" for folder in module.parents} | {module.as_posix(), f"{module.as_posix()}::{test}"}
        if names.intersection(NUMERICS):
            item.add_marker(pytest.mark.numerics)


def pytest_runtest_setup(item):
    """``@pytest.mark.repo_files("examples", ...)``: skip, with the reason, when the tests run
    from outside a checkout (say, against an installed wheel) and those files are absent."""
    for mark in item.iter_markers("repo_files"):
        missing = [p for p in mark.args if not (REPO / p).exists()]
        if missing:
            pytest.skip(f"needs the repository's {', '.join(missing)} (absent next to these tests: {REPO})")
