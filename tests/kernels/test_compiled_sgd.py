"""O7's compiled SGD: inductor's kernel equals the eager reference bit for bit.

On CPU the compiled path is forced (it is there for accelerators; inductor's C++ backend runs
the same graph here), with a fresh ``TORCHINDUCTOR_CACHE_DIR`` (``test_compiled_update.py``'s
fixture): momentum 0 and 0.9, dampening, Nesterov, weight decay, maximize, float32 and bf16
buffers, first and later steps, sizes 1, 7 and 1023 with special values (NaN payloads aside), a
run from an offset and every element's index, shards, non-contiguous and empty tensors. One graph serves every
option (they are flags in a tensor), so the whole matrix compiles 9 graphs. The ``cuda`` test
compares CUDA with the reference on CPU.
"""
import logging

import pytest
import torch

from ampkit._kernels import compiled_sgd, compiled_update, fused_sgd
from tests.kernels.test_compiled_update import fresh_inductor_cache, tensors  # noqa: F401 (the fixture)
from tests.kernels.test_fused_sgd import HYPERS, bits, clone, same

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")


def sgd_tensors(n: int, state, seed: int = 0):
    """Weight, gradient (special values meeting in the first elements) and buffer (None when ``state`` is None)."""
    w, g, m, _ = tensors(n, state or torch.float32, seed)
    return [w, g, None if state is None else m]


def same_but_nan_payloads(a, b) -> bool:
    """Bit for bit, NaN payloads aside: the sign of a NaN that arithmetic makes (``inf - inf``) is
    the code's (inductor's scalar C++ and torch's eager loops differ there)."""
    return all((x is None and y is None) or (x.dtype == y.dtype and torch.equal(x.isnan(), y.isnan())
                                             and torch.equal(bits(x)[~x.isnan()], bits(y)[~y.isnan()]))
               for x, y in zip(a, b))


def check(ts, hyper, index, steps=3):
    """``steps`` steps (the buffer made on the first) of copies of ``ts``: compiled == eager, bit for bit."""
    ref, got = clone(ts), clone(ts)
    for step in range(steps):
        fused_sgd.step_(*ref, hyper, step == 0, 1234, step, 5, index)
        compiled_sgd.step_(*got, hyper, step == 0, 1234, step, 5, index)
        assert not compiled_update._failed  # compiled, not the eager fallback (a recompile limit, say)
        assert same_but_nan_payloads(ref, got), (hyper, step, ts[0].numel())
    return got


@pytest.mark.slow  # a few seconds of inductor compilation per graph on a 2-core machine
@pytest.mark.parametrize("state", [None, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("indexed", [False, True])
def test_compiled_equals_the_eager_reference(state, indexed):
    """Every option of `test_fused_sgd.HYPERS` with (momentum 0.9) or without (0) a buffer."""
    hypers = [h for h in HYPERS if (h.momentum == 0) == (state is None)]
    for n in [7, 1023] + ([] if indexed else [1]):
        index = torch.randperm(3 * n, generator=torch.Generator().manual_seed(n))[:n] if indexed else 17
        for hyper in hypers:
            got = check(sgd_tensors(n, state), hyper, index)
        if n > 100:  # it stepped: weights and buffer moved
            fresh = sgd_tensors(n, state)
            assert not torch.equal(bits(got[0]), bits(fresh[0])) and (state is None or not torch.equal(got[2], fresh[2]))


@pytest.mark.slow
@pytest.mark.parametrize("state", [torch.float32, torch.bfloat16])
def test_shards_non_contiguous_and_empty_tensors(state):
    """A parameter stepped whole (a run) equals its pieces stepped from their offsets and one
    piece stepped with every element's index; a stride-2 tensor steps as its contiguous copy;
    an empty one is left alone."""
    hyper = fused_sgd.Hyper(0.05, 0.9, 0.0, 0.01, True, False)
    whole = sgd_tensors(1000, state)
    pieces, strided = clone(whole), [torch.empty(2000, dtype=t.dtype)[::2].copy_(t) for t in whole]
    for new in (True, False):
        compiled_sgd.step_(*whole, hyper, new, 9, 4, 2, 0)
        for a, b in [(0, 333), (333, 334)]:
            compiled_sgd.step_(*(t[a:b] for t in pieces), hyper, new, 9, 4, 2, a)
        compiled_sgd.step_(*(t[334:] for t in pieces), hyper, new, 9, 4, 2, torch.arange(334, 1000))
        compiled_sgd.step_(*strided, hyper, new, 9, 4, 2, 0)
    assert not strided[0].is_contiguous() and same(whole, pieces) and same(whole, strided)
    empty = sgd_tensors(0, state)
    compiled_sgd.step_(*empty, hyper, True, 9, 4, 2, 0)
    assert all(t.numel() == 0 for t in empty)


def test_a_failed_compilation_logs_one_line_and_steps_the_eager_reference(monkeypatch, caplog):
    """As O7's AdamW (the same fallback): the eager reference steps, the device is then unavailable."""
    def broken(indexed):
        raise RuntimeError("no backend here\nsecond line")

    monkeypatch.setattr(compiled_sgd, "_compiled", broken)
    monkeypatch.setattr(compiled_update, "ON_CPU", True)
    monkeypatch.setattr(compiled_update, "_failed", set())
    hyper = fused_sgd.Hyper(0.05, 0.9, 0.1, 0.01, False, True)
    ref = sgd_tensors(999, torch.bfloat16)
    got = clone(ref)
    with caplog.at_level(logging.WARNING, logger="ampkit"):
        for new in (True, False):
            fused_sgd.step_(*ref, hyper, new, 1, 1, 1, 0)
            compiled_sgd.step_(*got, hyper, new, 1, 1, 1, 0)
            assert not compiled_update.available(torch.device("cpu"))
    lines = [r.getMessage() for r in caplog.records if "compiled O7 update failed" in r.getMessage()]
    assert len(lines) == 1 and "no backend here" in lines[0] and "second line" not in lines[0]
    assert same(ref, got)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("state", [None, torch.float32, torch.bfloat16])
def test_cuda_compiled_equals_the_reference_on_cpu(state):
    """Triton under ``compiled_update.OPTIONS`` gives the CPU reference's bits, first and later steps."""
    if not compiled_update.available(torch.device("cuda")):
        pytest.skip("no Triton")
    hypers = [h for h in HYPERS if (h.momentum == 0) == (state is None)]
    for n, index in [(1001, 17), (3 * 2**20 + 7, 0), (999, torch.randperm(5000)[:999])]:
        for hyper in hypers:
            ref = sgd_tensors(n, state)
            got = [None if t is None else t.cuda() for t in ref]
            for step in range(2):
                fused_sgd.step_(*ref, hyper, step == 0, 5, step, 1, index)
                compiled_sgd.step_(*got, hyper, step == 0, 5, step, 1, index.cuda() if torch.is_tensor(index) else index)
            assert same_but_nan_payloads(ref, [None if t is None else t.cpu() for t in got]), (n, hyper)
