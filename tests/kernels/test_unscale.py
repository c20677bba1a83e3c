"""The gradient check and unscale (``ampkit/_kernels/unscale.py``): torch's fused kernels and the C
kernels, the same flags and bits."""
import pytest
import torch

from ampkit._kernels import native, unscale
from ampkit._kernels.unscale import copy_unscale_and_check_, unscale_and_check_


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_unscale_and_check_(dtype):
    grads = [torch.full((3,), 8.0, dtype=dtype), torch.full((2, 2), 4.0, dtype=dtype)]
    found = {}
    unscale_and_check_(grads, 0.25, found)
    assert torch.equal(grads[0], torch.full((3,), 2.0, dtype=dtype)) and grads[1].dtype == dtype
    assert found[torch.device("cpu")].item() == 0.0
    grads.append(torch.tensor([1.0, float("nan")], dtype=dtype))
    unscale_and_check_(grads, 1.0, found)
    assert found[torch.device("cpu")].item() == 1.0


SPECIALS = {torch.float32: [0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFFFFFFFF],  # +-inf, NaNs
            torch.float16: [0x7C00, 0xFC00, 0x7E00, 0x7C01, 0xFFFF],
            torch.bfloat16: [0x7F80, 0xFF80, 0x7FC0, 0x7F81, 0xFFFF]}
EDGES = {torch.float32: [0x7F7FFFFF, 0xFF7FFFFF, 0x00000001, 0x80000000],  # +-max, a subnormal, -0
         torch.float16: [0x7BFF, 0xFBFF, 0x0001, 0x8000], torch.bfloat16: [0x7F7F, 0xFF7F, 0x0001, 0x8000]}


def _bits(t):
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_scale_of_one_checks_without_writing_and_flags_every_special_anywhere(lib, dtype):
    """Unscaling by 1 reads the large tensors with the C kernel (1 or 2 threads): a finite edge
    value never flags, any inf or NaN at the start, the middle or the end does, and no bit of
    any gradient changes; small and strided ones still take torch's kernel."""
    n = 2 * native.MIN_PER_THREAD + 5
    base = (torch.randn(n) * 1e3).to(dtype)
    _bits(base)[:4] = torch.tensor(EDGES[dtype]).to(_bits(base).dtype)
    small, strided = torch.ones(9, dtype=dtype), torch.ones(n, 2, dtype=dtype)[:, 0]
    left = unscale._check_without_unscaling([base, small, strided], torch.zeros(1))
    assert [id(t) for t in left] == [id(small), id(strided)]  # the large contiguous one was read by the kernel
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            grads = [base.clone(), small, strided]
            found = {}
            unscale_and_check_(grads, 1.0, found)
            assert found[torch.device("cpu")].item() == 0.0 and torch.equal(_bits(grads[0]), _bits(base))
            for special in SPECIALS[dtype]:
                for at in (0, n // 2 + 1, n - 1):
                    g = base.clone()
                    _bits(g)[at] = torch.tensor(special).to(_bits(g).dtype)
                    before, found = _bits(g).clone(), {}
                    unscale_and_check_([g, small], 1.0, found)
                    assert found[torch.device("cpu")].item() == 1.0, (hex(special), at, count)
                    assert torch.equal(_bits(g), before)
            for g in (small, strided):  # left to torch's kernel, which flags them too
                g[3], found = float("nan"), {}
                unscale_and_check_([base.clone(), g], 1.0, found)
                assert found[torch.device("cpu")].item() == 1.0
                g[3] = 1.0
    finally:
        torch.set_num_threads(threads)


def _torch_path(monkeypatch, dst, src, inv):
    """copy_unscale_and_check_ through torch's kernels alone (no C kernels)."""
    found = {}
    with monkeypatch.context() as m:
        m.setattr(unscale.native, "library", lambda: None)
        copy_unscale_and_check_(dst, src, inv, found)
    return found[torch.device("cpu")].item()


def _same_values(a, b):
    """Bit for bit, NaN payloads aside."""
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and torch.equal(a[~nan].view(torch.int32), b[~nan].view(torch.int32))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_gradients_widen_and_unscale_in_one_pass_as_torchs_kernels_do(lib, dtype, monkeypatch):
    """The move of half gradients into fp32 master gradients: the C kernel (1 or 2 threads)
    gives torch's copy-then-unscale values and flag for any scale (1 kept exact, a product that
    overflows not flagged: torch checks the values before scaling), an inf or NaN anywhere in
    any pair, and writes every pair after one that overflowed; small, strided and fp32 pairs
    take torch's kernels."""
    n = 2 * native.MIN_PER_THREAD + 5
    torch.manual_seed(0)
    srcs = [(torch.randn(n) * 1e3).clamp(-6e4, 6e4).to(dtype) for _ in range(3)]
    _bits(srcs[1])[:4] = torch.tensor(EDGES[dtype]).to(torch.int16)
    _bits(srcs[2])[:3] = torch.tensor([0x0001, 0x03FF, 0x8200] if dtype == torch.float16 else [0x0001, 0x007F, 0x8040]).to(torch.int16)  # subnormals
    others = [torch.ones(9, dtype=dtype), torch.ones(n, 2, dtype=dtype)[:, 0], torch.ones(n)]
    left = unscale._widen_and_unscale([torch.empty(n) for _ in range(6)], srcs + others, 0.5, torch.zeros(1))
    assert [id(t) for t in left[1]] == [id(t) for t in others]  # the three large half ones were the kernel's
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            cases = [(None, 0, inv) for inv in (1.0, 0.5, 2.0**-24, 3.0)]
            cases += [(sp, at, 0.25) for sp in SPECIALS[dtype] for at in (0, n // 2, n - 1)]
            for special, at, inv in cases:
                src = [t.clone() for t in srcs] + others
                if special is not None:
                    _bits(src[0])[at] = torch.tensor(special).to(torch.int16)  # the first pair overflows
                got, want = ([torch.full((t.numel(),), -7.0) for t in src] for _ in range(2))
                found = {}
                copy_unscale_and_check_(got, src, inv, found)
                assert found[torch.device("cpu")].item() == _torch_path(monkeypatch, want, src, inv)
                assert found[torch.device("cpu")].item() == (0.0 if special is None else 1.0), (special, at, count)
                assert all(_same_values(a, b) for a, b in zip(got, want)), (special, inv, count)
    finally:
        torch.set_num_threads(threads)


def _half_grads(dtype):
    """Gradients of several sizes, one non-contiguous, with values that fp16 only holds scaled."""
    g = torch.Generator().manual_seed(0)
    shapes = [(5,), (3, 7), (40,), (1,), (6, 4)]
    grads = [(torch.randn(s, generator=g) * 2.0**12).to(dtype) for s in shapes]
    grads[1] = grads[1].t()  # non-contiguous source
    return grads


@pytest.mark.parametrize("block", [8, 2**18])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_copy_unscale_and_check_matches_two_passes(dtype, block, monkeypatch):
    """Block by block (tensors split and regrouped) or whole, the result is the exact product
    of the fp32 value and the power-of-two inverse scale, in the fp32 buffers."""
    monkeypatch.setattr(unscale, "CACHE_BLOCK", block)
    src = _half_grads(dtype)
    dst = [torch.full(s.shape, float("nan")) for s in src]
    found = {}
    copy_unscale_and_check_(dst, src, 2.0**-16, found)
    for d, s in zip(dst, src):
        assert d.dtype == torch.float32 and torch.equal(d, s.float() * 2.0**-16)
    assert found[torch.device("cpu")].item() == 0.0


@pytest.mark.parametrize("where", [(0, 2), (2, 0), (2, 39), (4, 23)])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_copy_unscale_and_check_flags_any_block(bad, where, monkeypatch):
    monkeypatch.setattr(unscale, "CACHE_BLOCK", 8)
    src = _half_grads(torch.float16)
    i, j = where
    src[i].view(-1)[j] = bad
    found = {torch.device("cpu"): torch.zeros(1)}
    copy_unscale_and_check_([torch.empty(s.shape) for s in src], src, 0.5, found)
    assert found[torch.device("cpu")].item() == 1.0
    # A flag already raised stays raised.
    copy_unscale_and_check_([torch.empty(3)], [torch.ones(3, dtype=torch.float16)], 1.0, found)
    assert found[torch.device("cpu")].item() == 1.0


def test_cache_blocks_cover_every_element_once(monkeypatch):
    monkeypatch.setattr(unscale, "CACHE_BLOCK", 8)
    src = _half_grads(torch.bfloat16)
    dst = [torch.zeros(s.shape) for s in src]
    blocks = list(unscale._cache_blocks(dst, src))
    assert all(sum(d.numel() for d in bd) >= 8 for bd, _ in blocks[:-1])
    for bd, bs in blocks:
        for d, s in zip(bd, bs):
            assert d.shape == s.shape
            d.add_(1.0)
    assert all(torch.equal(d, torch.ones(d.shape)) for d in dst)
