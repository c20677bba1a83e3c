"""float32 BatchNorm taking half input (train and eval, every variant), and convert_batchnorm."""
import copy
import pickle

import pytest
import torch
from torch import nn

from ampkit import NoEffectWarning
from ampkit._model import batchnorm
from ampkit.normalization import convert_batchnorm, enable_mixed_input_batchnorm
from ampkit._model.batchnorm import CastInputToFloat, CastOutputBack

HALF = [torch.float16, torch.bfloat16]
TOL = {torch.float16: 3e-3, torch.bfloat16: 2e-2}
VARIANTS = {
    "1d-2D": (nn.BatchNorm1d, (16, 3), None),
    "1d-3D": (nn.BatchNorm1d, (8, 3, 5), None),
    "2d": (nn.BatchNorm2d, (4, 3, 5, 5), None),
    "2d-channels_last": (nn.BatchNorm2d, (4, 3, 5, 5), torch.channels_last),
    "3d-channels_last": (nn.BatchNorm3d, (2, 3, 2, 3, 3), torch.channels_last_3d),
    "sync": (nn.SyncBatchNorm, (4, 3, 5, 5), None),
}
CONFIGS = {"default": {}, "affine=False": {"affine": False}, "no-running-stats": {"track_running_stats": False}}


@pytest.fixture(params=["native", "cast"])
def path(request, monkeypatch):
    """``cast`` forces the cast-around path the hooks use on device types without mixed kernels."""
    if request.param == "cast":
        monkeypatch.setattr(batchnorm, "NATIVE_MIXED_DEVICES", frozenset())
    return request.param


def make_bn(cls, config, device):
    bn = cls(3, **config).to(device)
    with torch.no_grad():
        for p in bn.parameters():
            p.copy_(torch.randn_like(p))
        if bn.running_mean is not None:
            bn.running_mean.copy_(torch.randn(3))
            bn.running_var.copy_(torch.rand(3) + 0.5)
    return bn


def stats(bn):
    return {k: v.clone() for k, v in bn.named_buffers()}


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("variant", VARIANTS.values(), ids=VARIANTS.keys())
def test_float32_batchnorm_takes_half_input(variant, config, dtype, train, path, device):
    cls, shape, memory_format = variant
    bn = make_bn(cls, config, device).train(train)
    ref = copy.deepcopy(bn)
    assert enable_mixed_input_batchnorm(bn) == 1
    x = torch.randn(shape, device=device) * 2 + 1
    if memory_format is not None:
        x = x.contiguous(memory_format=memory_format)
    x = x.to(dtype).requires_grad_()
    before = stats(bn)

    y = bn(x)
    y_ref = ref(x.detach().float())  # float32 BatchNorm on the same (rounded) values

    assert y.dtype == dtype and y.shape == x.shape
    if memory_format is not None:
        assert y.is_contiguous(memory_format=memory_format)
    torch.testing.assert_close(y.float(), y_ref, atol=TOL[dtype] * 4, rtol=TOL[dtype])
    for name, value in bn.named_buffers():
        assert value.dtype == before[name].dtype
        if not train:
            assert torch.equal(value, before[name]), name
        elif name == "num_batches_tracked":
            assert value.item() == before[name].item() + 1
        else:
            assert value.dtype == torch.float32 and not torch.equal(value, before[name])
            torch.testing.assert_close(value, dict(ref.named_buffers())[name], atol=TOL[dtype], rtol=TOL[dtype])
    y.float().square().sum().backward()
    assert x.grad.dtype == dtype and torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    for p in bn.parameters():
        assert p.dtype == torch.float32 and p.grad.dtype == torch.float32 and p.grad.abs().sum() > 0


def test_native_path_is_untouched_and_cast_path_casts(monkeypatch):
    bn = make_bn(nn.BatchNorm2d, {}, "cpu").eval()
    x = torch.randn(2, 3, 4, 4, dtype=torch.bfloat16)
    plain = bn(x)
    enable_mixed_input_batchnorm(bn)
    assert torch.equal(bn(x), plain)  # CPU runs mixed dtypes natively: hooks do nothing
    seen = []
    bn.register_forward_hook(lambda m, args, out: seen.append((args[0].dtype, out.dtype)), prepend=True)
    monkeypatch.setattr(batchnorm, "NATIVE_MIXED_DEVICES", frozenset())
    y = bn(x)
    assert seen == [(torch.float32, torch.float32)] and y.dtype == torch.bfloat16
    assert torch.equal(y, nn.functional.batch_norm(
        x.float(), bn.running_mean, bn.running_var, bn.weight, bn.bias, False, 0.0, bn.eps).bfloat16())
    assert bn(x.float()).dtype == torch.float32  # float32 input is left alone


def hook_counts(module):
    pre = sum(isinstance(h, CastInputToFloat) for h in module._forward_pre_hooks.values())
    post = sum(isinstance(h, CastOutputBack) for h in module._forward_hooks.values())
    return pre, post


def test_counts_only_float32_batchnorm_and_is_idempotent():
    model = nn.Sequential(
        nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3), nn.Sequential(nn.BatchNorm2d(3, affine=False)),
        nn.BatchNorm2d(3).half(), nn.BatchNorm2d(3).double(), nn.LayerNorm(3),
    )
    assert enable_mixed_input_batchnorm(model) == 2
    assert enable_mixed_input_batchnorm(model) == 2
    assert [hook_counts(m) for m in (model[1], model[2][0], model[3], model[4])] == [(1, 1), (1, 1), (0, 0), (0, 0)]
    assert hook_counts(model[0]) == (0, 0)


def test_hooks_survive_deepcopy_and_pickle(monkeypatch):
    monkeypatch.setattr(batchnorm, "NATIVE_MIXED_DEVICES", frozenset())
    bn = make_bn(nn.BatchNorm1d, {}, "cpu").eval()
    enable_mixed_input_batchnorm(bn)
    x = torch.randn(4, 3, dtype=torch.float16)
    for clone in (copy.deepcopy(bn), pickle.loads(pickle.dumps(bn))):
        assert hook_counts(clone) == (1, 1)
        assert torch.equal(clone(x), bn(x)) and clone(x).dtype == torch.float16
        assert enable_mixed_input_batchnorm(clone) == 1 and hook_counts(clone) == (1, 1)


@pytest.mark.parametrize("dtype", HALF)
def test_convert_batchnorm(dtype, device):
    model = nn.Sequential(nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3), nn.SyncBatchNorm(3, affine=False),
                          nn.BatchNorm1d(3, track_running_stats=False)).to(device)
    params = list(model.parameters())
    assert convert_batchnorm(model, dtype) is model
    assert list(model.parameters()) == params  # same Parameter objects
    assert model[0].weight.dtype == torch.float32
    for m in model[1:]:
        for name, t in list(m.named_parameters()) + list(m.named_buffers()):
            assert t.dtype == (torch.long if name == "num_batches_tracked" else dtype), name
    bn = model[1].eval()
    x = torch.randn(2, 3, 4, 4, device=device, dtype=dtype)
    before = stats(bn)
    assert bn(x).dtype == dtype and all(torch.equal(v, before[k]) for k, v in bn.named_buffers())


def test_convert_batchnorm_without_batchnorm_warns_and_returns_the_model():
    model = nn.Linear(2, 2)
    with pytest.warns(NoEffectWarning, match="no BatchNorm"):
        assert convert_batchnorm(model, torch.bfloat16) is model
    assert model.weight.dtype == torch.float32


def test_convert_batchnorm_rejects_non_float_dtype():
    with pytest.raises(TypeError, match="floating"):
        convert_batchnorm(nn.BatchNorm1d(3), torch.int32)
