"""O7's compiled update: inductor's kernel equals the eager reference bit for bit.

On CPU the compiled path is forced (it is there for accelerators; inductor's C++ backend
runs the same graph here), with a fresh ``TORCHINDUCTOR_CACHE_DIR``: odd sizes (1 and 2+
compile apart), both state dtypes, AdamW / Adam with L2 and maximize / Adam without decay,
the run and the per-element index, subnormals, signed zeros, infinities and NaN, shards,
non-contiguous and empty tensors. The ``cuda`` test compares CUDA with the reference on CPU.
"""
import logging

import pytest
import torch

from ampkit._kernels import compiled_update, fused_adamw
from ampkit._kernels.fused_adamw import Hyper

# Inductor imports torch.utils.mkldnn, whose class bodies use torch.jit.script_method: torch's own
# deprecation, once per process, not ampkit's.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")

HYPERS = [Hyper(1e-3, 0.9, 0.999, 1e-8, 0.01, True, False, 3.0),  # AdamW
          Hyper(3e-2, 0.8, 0.99, 1e-6, 0.1, False, True, 1.0),  # Adam with L2 decay, maximize
          Hyper(1e-3, 0.9, 0.999, 1e-8, 0.0, False, False, 7.0)]  # Adam without decay
SPECIAL = [0.0, -0.0, 1e-40, -1e-40, 1e-20, -3e38, float("inf"), float("nan")]


@pytest.fixture(scope="module", autouse=True)
def fresh_inductor_cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("inductor")))
        yield


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def tensors(n: int, state_dtype, seed: int = 0):
    """Weight, gradient, state: random, with special values in the first elements (each
    special weight meets each special gradient, and special state)."""
    g = torch.Generator().manual_seed(seed)
    out = [torch.randn(n, generator=g), torch.randn(n, generator=g) * 1e-2,
           torch.randn(n, generator=g) * 1e-3, torch.rand(n, generator=g) * 1e-5]
    k = min(n, len(SPECIAL) ** 2)
    special = torch.tensor(SPECIAL)
    out[0][:k], out[1][:k] = special.repeat_interleave(len(SPECIAL))[:k], special.repeat(len(SPECIAL))[:k]
    out[2][:k], out[3][:k] = special.repeat(len(SPECIAL))[:k].flip(0), special.repeat(len(SPECIAL))[:k].abs()
    return [t.to(d) for t, d in zip(out, [torch.bfloat16, torch.bfloat16, state_dtype, state_dtype])]


def check(n: int, state_dtype, index, hyper: Hyper):
    ref = tensors(n, state_dtype)
    got = [t.clone() for t in ref]
    fused_adamw.step_(*ref, hyper, 5, 2, 1, index, lib=None)
    compiled_update.step_(*got, hyper, 5, 2, 1, index)
    assert not compiled_update._failed  # compiled, not the eager fallback (a recompile limit, say)
    for name, a, b in zip(("w", "grad", "m", "v"), ref, got):
        assert a.dtype == b.dtype and torch.equal(bits(a), bits(b)), (n, state_dtype, hyper, name)
    if n > 100:  # it stepped: weights and state moved
        fresh = tensors(n, state_dtype)
        assert not torch.equal(bits(got[0]), bits(fresh[0])) and not torch.equal(bits(got[2]), bits(fresh[2]))


@pytest.mark.slow  # about 10 s of inductor compilation per graph on a 2-core machine
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("indexed", [False, True])
def test_compiled_equals_the_eager_reference(state_dtype, indexed):
    sizes = [7, 1001, 2 * 32768 + 5] + ([] if indexed else [1])
    for n in sizes:
        index = torch.randperm(3 * n, generator=torch.Generator().manual_seed(n))[:n] if indexed else 17
        for hyper in HYPERS:
            check(n, state_dtype, index, hyper)


@pytest.mark.slow
def test_shards_non_contiguous_and_empty_tensors():
    """A parameter stepped whole (a run) equals its pieces stepped from their offsets and one
    piece stepped with every element's index; a stride-2 tensor steps as its contiguous copy;
    an empty one is left alone."""
    whole = tensors(1000, torch.bfloat16)
    pieces, strided = [t.clone() for t in whole], [torch.empty(2000, dtype=t.dtype)[::2].copy_(t) for t in whole]
    compiled_update.step_(*whole, HYPERS[0], 9, 4, 2, 0)
    for a, b in [(0, 333), (333, 334)]:
        compiled_update.step_(*(t[a:b] for t in pieces), HYPERS[0], 9, 4, 2, a)
    compiled_update.step_(*(t[334:] for t in pieces), HYPERS[0], 9, 4, 2, torch.arange(334, 1000))
    compiled_update.step_(*strided, HYPERS[0], 9, 4, 2, 0)
    assert not strided[0].is_contiguous()
    assert all(torch.equal(bits(x), bits(y)) and torch.equal(bits(x), bits(z)) for x, y, z in zip(whole, pieces, strided))
    empty = tensors(0, torch.float32)
    compiled_update.step_(*empty, HYPERS[0], 9, 4, 2, 0)
    assert all(t.numel() == 0 for t in empty)


def test_available_where_triton_runs(monkeypatch):
    """CUDA and XPU with Triton; CPU only under the tests' switch; other devices never;
    ``AMPKIT_COMPILED_UPDATE=0`` nowhere."""
    import torch.utils._triton as triton_utils
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.setattr(triton_utils, "has_triton", lambda: False)
    assert not compiled_update.available(cuda) and not compiled_update.available(cpu)
    monkeypatch.setattr(triton_utils, "has_triton", lambda: True)
    assert compiled_update.available(cuda) and compiled_update.available(torch.device("xpu"))
    assert not compiled_update.available(torch.device("mps")) and not compiled_update.available(torch.device("meta"))
    monkeypatch.setattr(compiled_update, "ON_CPU", True)
    assert compiled_update.available(cpu)
    monkeypatch.setenv("AMPKIT_COMPILED_UPDATE", "0")
    assert not compiled_update.available(cuda) and not compiled_update.available(cpu)


def test_a_failed_compilation_logs_one_line_and_steps_the_eager_reference(monkeypatch, caplog):
    """The failing call steps in the eager reference (the same bits on CPU); the device is
    then unavailable, so later steps take the optimizer's own step, without more lines."""
    def broken(indexed):
        raise RuntimeError("no backend here\nsecond line")

    monkeypatch.setattr(compiled_update, "_compiled", broken)
    monkeypatch.setattr(compiled_update, "ON_CPU", True)
    monkeypatch.setattr(compiled_update, "_failed", set())
    ref = tensors(999, torch.bfloat16)
    got = [t.clone() for t in ref]
    with caplog.at_level(logging.WARNING, logger="ampkit"):
        for _ in range(2):
            fused_adamw.step_(*ref, HYPERS[0], 1, 1, 1, 0, lib=None)
            compiled_update.step_(*got, HYPERS[0], 1, 1, 1, 0)
            assert not compiled_update.available(torch.device("cpu"))
    lines = [r.getMessage() for r in caplog.records if "compiled O7 update failed" in r.getMessage()]
    assert len(lines) == 1 and "no backend here" in lines[0] and "second line" not in lines[0]
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(ref, got))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_cuda_compiled_equals_the_reference_on_cpu(state_dtype):
    """Triton under ``OPTIONS`` gives the CPU reference's bits (eager CUDA itself would not:
    it divides by a Python scalar as a multiplication by its reciprocal)."""
    if not compiled_update.available(torch.device("cuda")):
        pytest.skip("no Triton")
    for n, index in [(1001, 17), (3 * 2**20 + 7, 0), (999, torch.randperm(5000)[:999])]:
        for hyper in HYPERS:
            ref = tensors(n, state_dtype)
            got = [t.cuda() for t in ref]
            fused_adamw.step_(*ref, hyper, 5, 2, 1, index, lib=None)
            compiled_update.step_(*got, hyper, 5, 2, 1, index.cuda() if torch.is_tensor(index) else index)
            for a, b in zip(ref, got):  # NaN payloads aside (the float-to-bfloat16 conversions may differ there)
                b = b.cpu()
                assert torch.equal(a.isnan(), b.isnan()) and torch.equal(bits(a)[~a.isnan()], bits(b)[~b.isnan()]), (n, hyper)
