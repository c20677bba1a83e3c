import math

import pytest
import torch

from ampkit.core import scaler
from ampkit.core.scaler import LossScaler, copy_unscale_and_check_, unscale_and_check_


def test_dynamic_defaults_follow_apex():
    s = LossScaler("dynamic")
    assert (s.scale, s.growth_interval, s.growth_factor, s.backoff_factor, s.max_loss_scale) == (2.0**16, 2000, 2.0, 0.5, 2.0**24)


def test_dynamic_growth_and_backoff():
    s = LossScaler("dynamic", growth_interval=2)
    assert s.update(False) is False and s.scale == 2.0**16 and s.unskipped == 1
    assert s.update(False) is False and s.scale == 2.0**17 and s.unskipped == 0
    assert s.update(True) is True and s.scale == 2.0**16 and s.unskipped == 0
    assert s.skipped_steps == 1


def test_static_scale_skips_but_never_moves():
    s = LossScaler(128.0)
    assert s.update(True) is True and s.scale == 128.0
    for _ in range(5000):
        s.update(False)
    assert s.scale == 128.0 and s.skipped_steps == 1


def test_clamps_and_never_reaches_zero():
    s = LossScaler("dynamic", min_loss_scale=4.0, max_loss_scale=8.0, growth_interval=1)
    assert s.scale == 8.0
    s.update(False)
    assert s.scale == 8.0
    for _ in range(5):
        s.update(True)
    assert s.scale == 4.0 and s.at_floor
    free = LossScaler("dynamic")
    for _ in range(2000):
        free.update(True)
    assert free.scale > 0 and math.isfinite(free.scale)


def test_hysteresis_tolerates_h_minus_one_overflows():
    s = LossScaler("dynamic", hysteresis=3)
    s.update(True), s.update(True)
    assert s.scale == 2.0**16 and s.skipped_steps == 2
    s.update(True)
    assert s.scale == 2.0**15
    s.update(True)
    assert s.scale == 2.0**14  # still in the streak: every further overflow backs off
    s.update(False)
    s.update(True)
    assert s.scale == 2.0**14  # a clean step resets the streak


def test_state_dict_round_trip_and_validation():
    s = LossScaler("dynamic")
    s.update(False)
    assert s.state_dict() == {"loss_scale": 65536.0, "unskipped": 1}
    t = LossScaler("dynamic")
    t.load_state_dict(s.state_dict())
    assert t.state_dict() == s.state_dict()
    for bad in ({"loss_scale": -1.0, "unskipped": 0}, {"loss_scale": 1.0, "unskipped": -3}, {"loss_scale": 1.0}):
        with pytest.raises(ValueError, match="loss_scaler0"):
            LossScaler.check_state("loss_scaler0", bad)


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
    monkeypatch.setattr(scaler, "CACHE_BLOCK", block)
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
    monkeypatch.setattr(scaler, "CACHE_BLOCK", 8)
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
    monkeypatch.setattr(scaler, "CACHE_BLOCK", 8)
    src = _half_grads(torch.bfloat16)
    dst = [torch.zeros(s.shape) for s in src]
    blocks = list(scaler._cache_blocks(dst, src))
    assert all(sum(d.numel() for d in bd) >= 8 for bd, _ in blocks[:-1])
    for bd, bs in blocks:
        for d, s in zip(bd, bs):
            assert d.shape == s.shape
            d.add_(1.0)
    assert all(torch.equal(d, torch.ones(d.shape)) for d in dst)
