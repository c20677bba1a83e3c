"""LPLayerNorm and apply_low_precision_layernorm: dtypes per device under autocast, values, surgery."""
import pytest
import torch
from torch import nn

import ampkit
from ampkit._common.errors import NoEffectWarning
from ampkit.normalization import LPLayerNorm, apply_low_precision_layernorm

HALF = [torch.float16, torch.bfloat16]
TOL = {torch.float16: 2e-3, torch.bfloat16: 2e-2}
CONFIGS = [{}, {"bias": False}, {"elementwise_affine": False}]


def _randomized(module):
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p))
    return module


def _reference(x, ln, dtype):
    """float64 layer norm of x and ln's parameters, all first rounded to ``dtype``."""
    cast = lambda t: None if t is None else t.detach().to(dtype).double()
    return torch.nn.functional.layer_norm(cast(x), ln.normalized_shape, cast(ln.weight), cast(ln.bias), ln.eps)


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_outside_autocast_equals_layernorm(config, dtype, device):
    ln = _randomized(nn.LayerNorm(8, eps=1e-4, **config)).to(device, dtype)
    lp = LPLayerNorm(8, eps=1e-4, **config).to(device, dtype)
    lp.load_state_dict(ln.state_dict())
    x = torch.randn(3, 5, 8, device=device, dtype=dtype, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    y, y2 = ln(x), lp(x2)
    assert y2.dtype == dtype and torch.equal(y, y2)
    y.square().sum().backward()
    y2.square().sum().backward()
    assert torch.equal(x.grad, x2.grad)
    for p, q in zip(ln.parameters(), lp.parameters()):
        assert torch.equal(p.grad, q.grad)


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("dtype", HALF)
def test_autocast_runs_in_half(config, dtype, device):
    lp = _randomized(LPLayerNorm(8, **config)).to(device)
    ln = nn.LayerNorm(8, **config).to(device)
    ln.load_state_dict(lp.state_dict())
    x = torch.randn(4, 8, device=device, requires_grad=True)
    with torch.autocast(device.type, dtype=dtype):
        y = lp(x)
        plain_fp32_in = ln(x)
        plain_half_in = ln(x.to(dtype))
    assert y.dtype == dtype
    torch.testing.assert_close(y.double(), _reference(x, lp, dtype), atol=TOL[dtype], rtol=TOL[dtype])
    # What LPLayerNorm fixes: CUDA autocast runs layer_norm in float32; CPU keeps the input dtype.
    assert plain_fp32_in.dtype == torch.float32
    assert plain_half_in.dtype == (torch.float32 if device.type == "cuda" else dtype)
    y.float().square().sum().backward()
    assert x.grad.dtype == torch.float32 and x.grad.abs().sum() > 0
    for p in lp.parameters():
        assert p.dtype == torch.float32 and p.grad.dtype == torch.float32 and p.grad.abs().sum() > 0


def test_compiles():
    lp = _randomized(LPLayerNorm(8))
    compiled = torch.compile(lp, backend="eager", fullgraph=True)
    x = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, ref = compiled(x), lp(x)
    assert y.dtype == torch.bfloat16 and torch.equal(y, ref)
    assert torch.equal(compiled(x), nn.functional.layer_norm(x, (8,), lp.weight, lp.bias))


def _projected(y):
    """A loss whose gradient is nonzero by construction: ``y`` against fixed random directions."""
    return (y.float() * torch.randn(y.shape, generator=torch.Generator().manual_seed(7))).sum()


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8, eps=1e-3)
        self.inner = nn.Sequential(nn.LayerNorm(8, bias=False), nn.ReLU(), nn.LayerNorm(8, elementwise_affine=False))
        self.tail = nn.LayerNorm(8)
        self.tail.weight = None  # edited after construction: affine, but without weight

    def forward(self, x):
        return self.tail(self.inner(self.norm(self.fc(x))))


@pytest.mark.parametrize("precision", ["amp_fp16", "amp_bf16", torch.float16, torch.bfloat16])
def test_apply_replaces_every_layernorm_keeping_parameters(precision):
    model = Block()
    model.inner.eval()
    _randomized(model)
    params = dict(model.named_parameters())
    olds = {n: m for n, m in model.named_modules() if type(m) is nn.LayerNorm}
    x = torch.randn(3, 8)
    before = model(x)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert apply_low_precision_layernorm(model, precision, opt) is model
    news = {n: m for n, m in model.named_modules() if isinstance(m, nn.LayerNorm)}
    assert news.keys() == olds.keys() and all(type(m) is LPLayerNorm for m in news.values())
    for name, new in news.items():
        old = olds[name]
        assert (new.normalized_shape, new.eps, new.elementwise_affine, new.training) == (
            old.normalized_shape, old.eps, old.elementwise_affine, old.training)
        assert new.weight is old.weight and new.bias is old.bias
    assert all(params[n] is p for n, p in model.named_parameters())
    assert torch.equal(model(x), before)
    # A random projection of the output: ``model(x).sum()`` would sum a LayerNorm's normalized
    # output over its own axis, which is zero in exact arithmetic, and so is every gradient behind it.
    _projected(model(x)).backward()
    w, grad = model.norm.weight.detach().clone(), model.norm.weight.grad
    assert grad.abs().max() > 1e-3  # far above rounding noise, on any CPU
    opt.step()
    torch.testing.assert_close(model.norm.weight.detach(), w - 0.1 * grad)  # SGD moved the same tensor


@pytest.mark.parametrize("precision", ["fp32", "amp_fp8", torch.float32, torch.float64])
def test_no_effect_precisions_warn_and_change_nothing(precision):
    model = Block()
    modules = list(model.modules())
    with pytest.warns(NoEffectWarning, match="no effect"):
        assert apply_low_precision_layernorm(model, precision) is model
    assert list(model.modules()) == modules and type(model.norm) is nn.LayerNorm


def test_no_layernorm_warns():
    model = nn.Sequential(nn.Linear(4, 4), nn.GroupNorm(2, 4))
    with pytest.warns(NoEffectWarning, match="no torch.nn.LayerNorm"):
        apply_low_precision_layernorm(model, "amp_bf16")
    assert type(model[1]) is nn.GroupNorm


def test_second_application_finds_nothing_and_subclasses_are_kept():
    class ChannelsFirstNorm(nn.LayerNorm):
        def forward(self, x):
            return super().forward(x.transpose(1, -1)).transpose(1, -1)

    model = nn.Sequential(nn.LayerNorm(4), ChannelsFirstNorm(4))
    apply_low_precision_layernorm(model, "amp_fp16")
    assert type(model[0]) is LPLayerNorm and type(model[1]) is ChannelsFirstNorm
    with pytest.warns(NoEffectWarning):
        apply_low_precision_layernorm(model, "amp_fp16")
    assert type(model[0]) is LPLayerNorm


@pytest.mark.parametrize("precision", ["fp16", "AMP_BF16", "bf16", 16, None, torch.int8])
def test_unknown_precision_lists_accepted(precision):
    model = Block()
    with pytest.raises(ValueError, match="unknown precision") as err:
        apply_low_precision_layernorm(model, precision)
    for accepted in ("'amp_fp16'", "'amp_bf16'", "torch.float16", "torch.bfloat16", "'fp32'"):
        assert accepted in str(err.value)
    assert type(model.norm) is nn.LayerNorm


@pytest.mark.parametrize("level,dtype", [("O1", torch.float16), ("O4", torch.bfloat16)])
def test_initialize_low_precision_layernorm(level, dtype):
    model = Block()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    params = list(model.parameters())
    model, opt = ampkit.initialize(model, opt, opt_level=level, low_precision_layernorm=True, loss_scale=128.0, verbosity=0)
    assert type(model.norm) is LPLayerNorm and list(model.parameters()) == params
    seen = []
    model.norm.register_forward_hook(lambda m, args, out: seen.append(out.dtype))
    loss = _projected(model(torch.randn(3, 8)))
    assert seen == [dtype]
    w = model.norm.weight.detach().clone()
    with ampkit.scale_loss(loss, opt) as scaled:
        scaled.backward()
    grad = model.norm.weight.grad
    assert grad.dtype == torch.float32 and grad.abs().max() > 1e-3  # unscaled, far above rounding noise
    opt.step()
    assert model.norm.weight.dtype == torch.float32
    torch.testing.assert_close(model.norm.weight.detach(), w - 0.1 * grad)
