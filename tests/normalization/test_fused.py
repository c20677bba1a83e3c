"""Apex-named fused norms: constructor, values against float64, dtypes, gradients."""
import pytest
import torch

from ampkit._common.errors import NoEffectWarning
from ampkit.normalization import FusedLayerNorm, FusedRMSNorm, MixedFusedLayerNorm, MixedFusedRMSNorm

PLAIN = [FusedLayerNorm, FusedRMSNorm]
MIXED = [MixedFusedLayerNorm, MixedFusedRMSNorm]
TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
EPS = 1e-3


def reference(cls, x, weight, bias, shape):
    """Float64 LayerNorm / RMSNorm over the last len(shape) dims."""
    x = x.double()
    dims = tuple(range(-len(shape), 0))
    if issubclass(cls, FusedRMSNorm):
        y = x * torch.rsqrt(x.square().mean(dims, keepdim=True) + EPS)
    else:
        mean = x.mean(dims, keepdim=True)
        y = (x - mean) * torch.rsqrt((x - mean).square().mean(dims, keepdim=True) + EPS)
    if weight is not None:
        y = y * weight.double()
    return y if bias is None else y + bias.double()


def make(cls, shape, device, dtype=torch.float32, **kw):
    norm = cls(shape, eps=EPS, **kw).to(device, dtype)
    with torch.no_grad():
        for p in norm.parameters():
            p.copy_(torch.randn_like(p) + (1 if p is norm.weight else 0))
    return norm


def test_constructor_matches_apex():
    ln, rms = FusedLayerNorm(6), FusedRMSNorm((2, 3), eps=1e-6, elementwise_affine=False)
    assert ln.normalized_shape == torch.Size([6]) and ln.eps == 1e-5 and ln.elementwise_affine
    assert torch.equal(ln.weight, torch.ones(6)) and torch.equal(ln.bias, torch.zeros(6))
    assert set(ln.state_dict()) == {"weight", "bias"}
    assert rms.normalized_shape == torch.Size([2, 3]) and rms.weight is None and not hasattr(rms, "bias")
    assert set(FusedRMSNorm(6).state_dict()) == {"weight"}
    assert repr(ln) == "FusedLayerNorm(torch.Size([6]), eps=1e-05, elementwise_affine=True)"
    for cls in MIXED:
        m = cls(6)
        assert m.elementwise_affine and all(p.dtype == torch.float32 for p in m.parameters())


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("cls", PLAIN)
def test_plain_matches_float64(cls, dtype, affine, device):
    shape = (4, 6)
    norm = make(cls, shape, device, dtype, elementwise_affine=affine)
    x = (torch.randn(3, 4, 6, device=device) * 3 + 1).to(dtype).requires_grad_()
    y = norm(x)
    assert y.dtype == dtype
    torch.testing.assert_close(y.double(), reference(cls, x, norm.weight, getattr(norm, "bias", None), shape),
                               atol=TOL[dtype], rtol=TOL[dtype])
    y.float().sum().backward()
    assert x.grad.dtype == dtype and torch.isfinite(x.grad).all()
    for p in norm.parameters():
        assert p.grad.dtype == dtype and p.grad.abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("cls", PLAIN)
def test_plain_float32_params_half_input_returns_input_dtype(cls, dtype, device):
    norm = make(cls, 6, device)
    x = torch.randn(5, 6, device=device, dtype=dtype)
    y = norm(x)
    assert y.dtype == dtype
    torch.testing.assert_close(y.double(), reference(cls, x, norm.weight.to(dtype), getattr(norm, "bias", None), (6,)),
                               atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("cls", MIXED)
def test_mixed_computes_in_float32_and_returns_input_dtype(cls, dtype, device):
    norm = make(cls, 6, device)
    x = (torch.randn(7, 6, device=device) * 3).to(dtype).requires_grad_()
    y = norm(x)
    assert y.dtype == dtype and all(p.dtype == torch.float32 for p in norm.parameters())
    x64 = x.detach().double().requires_grad_()
    params64 = [p.detach().double().requires_grad_() for p in norm.parameters()]
    weight64, bias64 = (params64 + [None])[:2]
    ref = reference(cls, x64, weight64, bias64, (6,))
    # Computed in float32 and rounded once: about one unit in the last place of dtype.
    one_ulp = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(y.double(), ref, atol=one_ulp * 4, rtol=one_ulp)
    grad_out = torch.randn(7, 6, device=device)
    y.backward(grad_out.to(dtype))
    ref.backward(grad_out.to(dtype).double())
    assert x.grad.dtype == dtype
    torch.testing.assert_close(x.grad.double(), x64.grad, atol=TOL[dtype] * 10, rtol=TOL[dtype] * 10)
    for p, p64 in zip(norm.parameters(), params64):
        assert p.grad.dtype == torch.float32
        torch.testing.assert_close(p.grad.double(), p64.grad, atol=TOL[dtype] * 10, rtol=TOL[dtype] * 10)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_under_autocast(dtype, device):
    x = torch.randn(4, 6, device=device)
    for cls in PLAIN + MIXED:
        norm = make(cls, 6, device)
        with torch.autocast(device.type, dtype=dtype):
            y, y_half = norm(x), norm(x.to(dtype))
        # Plain: Apex casts everything to the autocast dtype. Mixed: float32 math, input dtype out.
        assert y.dtype == (torch.float32 if cls in MIXED else dtype)
        assert y_half.dtype == dtype
        if cls in MIXED:
            assert torch.equal(y, norm(x))


def test_mixed_constructor_arguments():
    with pytest.raises(RuntimeError, match="does not support `elementwise_affine = False`"):
        MixedFusedLayerNorm(6, elementwise_affine=False)
    with pytest.raises(RuntimeError, match="MixedFusedRMSNorm"):
        MixedFusedRMSNorm(6, elementwise_affine=False)
    with pytest.warns(NoEffectWarning, match="elementwise_affine"):
        assert MixedFusedRMSNorm(6, elementwise_affine=True).weight.shape == (6,)
    with pytest.raises(TypeError, match="bias"):
        MixedFusedLayerNorm(6, bias=False)
    with pytest.raises(TypeError):
        MixedFusedLayerNorm(6, 1e-5, True)  # elementwise_affine is keyword-only, as in Apex


def test_memory_efficient_warns_and_computes_the_same():
    x = torch.randn(3, 6)
    with pytest.warns(NoEffectWarning, match="memory_efficient"):
        lean = FusedLayerNorm(6, memory_efficient=True)
    assert lean.memory_efficient and torch.equal(lean(x), FusedLayerNorm(6)(x))
