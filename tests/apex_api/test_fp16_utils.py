"""ampkit.fp16_utils (Apex's pre-amp API): conversion helpers, master-parameter helpers,
the loss scalers and FP16_Optimizer against a hand-written fp32-master loop."""
import copy

import pytest
import torch
from torch import nn

from ampkit import fp16_utils as fu


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.BatchNorm1d(8, affine=False), nn.ReLU(), nn.Linear(8, 3))


def test_to_python_float():
    assert fu.to_python_float(torch.tensor([2.5])) == 2.5 and isinstance(fu.to_python_float(torch.tensor(1.5)), float)
    assert fu.to_python_float([3.0]) == 3.0


def test_network_to_half_keeps_affine_bn_fp32():
    net = fu.network_to_half(_net())
    assert isinstance(net[0], fu.tofp16)
    body = net[1]
    assert body[0].weight.dtype == torch.float16 and body[4].weight.dtype == torch.float16
    assert body[1].weight.dtype == torch.float32 and body[1].running_mean.dtype == torch.float32
    assert body[2].running_mean.dtype == torch.float16  # affine=False BatchNorm goes to half, as in Apex
    assert fu.tofp16()(torch.ones(2)).dtype == torch.float16
    nested = nn.Sequential(nn.Sequential(nn.BatchNorm2d(3), nn.BatchNorm2d(3, affine=False))).half()
    assert fu.BN_convert_float(nested) is nested
    assert nested[0][0].weight.dtype == torch.float32 and nested[0][0].running_var.dtype == torch.float32
    assert nested[0][1].running_var.dtype == torch.float16


def test_convert_network_and_fp16model():
    net = _net()
    ref = [p.detach().clone() for p in net.parameters()]
    out = fu.convert_network(net, torch.float16)
    assert out is net
    assert [p.dtype for p in net.parameters()] == [torch.float16, torch.float16, torch.float32, torch.float32, torch.float16, torch.float16]
    assert torch.equal(net[0].weight, ref[0].half())
    m = fu.FP16Model(_net())
    m.eval()
    y = m(torch.randn(4, 6))
    assert y.dtype == torch.float16 and m.network[1].weight.dtype == torch.float32
    lstm = fu.convert_network(nn.LSTM(3, 4), torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in lstm.parameters())


@pytest.mark.parametrize("flat", [False, True])
def test_param_lists_round_trip(flat):
    model = nn.Linear(4, 3).half()
    model_params, masters = fu.prep_param_lists(model, flat_master=flat)
    assert model_params == list(model.parameters())
    assert all(m.dtype == torch.float32 and m.requires_grad for m in masters)
    assert len(masters) == (1 if flat else 2)
    model(torch.randn(2, 4).half()).sum().backward()
    fu.model_grads_to_master_grads(model_params, masters, flat_master=flat)
    grads = torch.cat([p.grad.float().flatten() for p in model_params])
    got = masters[0].grad if flat else torch.cat([m.grad.flatten() for m in masters])
    assert torch.equal(got, grads)
    with torch.no_grad():
        for m in masters:
            m.add_(0.125)
    fu.master_params_to_model_params(model_params, masters, flat_master=flat)
    vals = masters[0] if flat else torch.cat([m.flatten() for m in masters])
    assert torch.equal(torch.cat([p.flatten() for p in model_params]), vals.detach().half())


def test_model_grads_to_master_grads_none():
    p, m = nn.Parameter(torch.ones(2).half()), nn.Parameter(torch.ones(2))
    m.grad = torch.ones(2)
    fu.model_grads_to_master_grads([p], [m])
    assert m.grad is None


def test_loss_scalers():
    s = fu.LossScaler(8.0)
    assert s.loss_scale == 8.0 and s.cur_scale == 8.0
    s.update_scale(True)
    assert s.loss_scale == 8.0
    p = nn.Parameter(torch.ones(2))
    p.grad = torch.tensor([1.0, float("inf")])
    assert s.has_overflow([p])
    p.grad = torch.ones(2)
    assert not s.has_overflow([p]) and torch.equal(p.grad, torch.ones(2))
    d = fu.DynamicLossScaler(init_scale=4.0, scale_factor=2.0, scale_window=3)
    assert d.loss_scale == 4.0 and d.scale_factor == 2.0 and d.scale_window == 3
    for overflow, want in [(True, 2.0), (True, 1.0), (True, 1.0), (False, 1.0), (False, 1.0), (False, 2.0), (False, 2.0)]:
        d.update_scale(overflow)
        assert d.loss_scale == want
    x = torch.ones(2, requires_grad=True)
    d.backward(x.sum())
    assert torch.equal(x.grad, torch.full((2,), 2.0))


def _data(steps):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)) for _ in range(steps)]


def _half_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)).half()


def _reference(steps, scale, inf_at, clip):
    """The hand-written loop FP16_Optimizer replaces: fp32 masters, scaled backward,
    unscaled fp32 master grads, skip + halve on overflow, copy back into the half model."""
    model = _half_model()
    masters = [p.detach().clone().float().requires_grad_() for p in model.parameters()]
    opt = torch.optim.SGD(masters, lr=0.1, momentum=0.9)
    scales = []
    for i, (x, y) in enumerate(_data(steps)):
        for p in model.parameters():
            p.grad = None
        loss = ((model(x.half()).float() - y) ** 2).mean()
        (loss * scale).backward()
        if i == inf_at:
            model[0].weight.grad[0, 0] = float("inf")
        grads = [p.grad.float() / scale for p in model.parameters()]
        if not all(torch.isfinite(g).all() for g in grads):
            scale /= 2
            scales.append(scale)
            continue
        for m, g in zip(masters, grads):
            m.grad = g
        if clip:
            torch.nn.utils.clip_grad_norm_(masters, clip)
        opt.step()
        with torch.no_grad():
            for p, m in zip(model.parameters(), masters):
                p.copy_(m)
        scales.append(scale)
    return model, masters, scales


@pytest.mark.parametrize("dynamic,clip", [(True, None), (True, 0.05), (False, None)])
def test_fp16_optimizer_matches_hand_written_loop(dynamic, clip):
    steps, inf_at = 5, 2
    _, ref_masters, ref_scales = _reference(steps, 128.0, inf_at, clip)
    model = _half_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if dynamic:
        opt = fu.FP16_Optimizer(inner, dynamic_loss_scale=True, dynamic_loss_args={"init_scale": 128.0}, verbose=False)
    else:
        opt = fu.FP16_Optimizer(inner, static_loss_scale=128.0, verbose=False)
    scales, norms = [], []
    for i, (x, y) in enumerate(_data(steps)):
        opt.zero_grad()
        loss = ((model(x.half()).float() - y) ** 2).mean()
        if i == inf_at:
            opt.backward(loss, update_master_grads=False)
            model[0].weight.grad[0, 0] = float("inf")
            opt.update_master_grads()
            assert opt.overflow
        else:
            opt.backward(loss)
            assert not opt.overflow
        if clip:
            norms.append(opt.clip_master_grads(clip))
        opt.step()
        scales.append(opt.loss_scale)
    if dynamic:
        assert scales == ref_scales
        if clip:
            assert norms[inf_at] == -1 and all(n > 0 for j, n in enumerate(norms) if j != inf_at)
    else:
        assert scales == [128.0] * steps
    masters = [p for g in opt.param_groups for p in g["params"]]
    assert all(m.dtype == torch.float32 for m in masters)
    for m, r in zip(masters, ref_masters):
        torch.testing.assert_close(m, r, rtol=0, atol=1e-6)
    for p, m in zip(model.parameters(), masters):  # exactly its master, rounded: no tolerance on a half ulp
        assert p.dtype == torch.float16 and torch.equal(p, m.half())
    assert [[id(p) for p in g] for g in opt.fp16_groups] == [[id(p) for p in model.parameters()]]


def test_fp16_optimizer_accumulation_and_checkpoint():
    data = _data(3)
    model = _half_model()
    opt = fu.FP16_Optimizer(torch.optim.Adam(model.parameters(), lr=1e-2), static_loss_scale=64.0, verbose=False)
    opt.zero_grad()
    for x, y in data[:2]:
        opt.backward(((model(x.half()).float() - y) ** 2).mean(), update_master_grads=False)
    opt.update_master_grads()
    # the two scaled backwards summed, unscaled once
    ref = _half_model()
    for x, y in data[:2]:
        (((ref(x.half()).float() - y) ** 2).mean() * 64.0).backward()
    for m, p in zip([p for g in opt.param_groups for p in g["params"]], ref.parameters()):
        assert torch.equal(m.grad, p.grad.float() / 64.0)
    opt.step()
    sd = opt.state_dict()
    assert sd["loss_scaler"]["cur_scale"] == 64.0 and len(sd["fp32_from_fp16"][0]) == 4

    model2 = _half_model()
    opt2 = fu.FP16_Optimizer(torch.optim.Adam(model2.parameters(), lr=1e-2), static_loss_scale=2.0, verbose=False)
    opt2.load_state_dict(copy.deepcopy(sd))  # as from torch.load: torch's optimizer load shares tensors
    assert opt2.loss_scale == 64.0
    for a, b in zip(model2.parameters(), model.parameters()):
        assert torch.equal(a, b)
    for step in range(2):
        for o, m in ((opt, model), (opt2, model2)):
            o.zero_grad()
            x, y = data[2]
            o.backward(((m(x.half()).float() - y) ** 2).mean())
            o.step()
    for a, b in zip([p for g in opt.param_groups for p in g["params"]], [p for g in opt2.param_groups for p in g["params"]]):
        assert torch.equal(a, b)


def test_fp16_optimizer_bad_input():
    model = _half_model()
    with pytest.raises(TypeError, match="init_optimizer"):
        fu.FP16_Optimizer(model)
    with pytest.raises(ValueError, match="dynamic_loss_args"):
        fu.FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), dynamic_loss_args={"init_scale": 2.0})
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="LossScaler\\(scale=...\\): expected a positive finite number, got 0"):
        fu.FP16_Optimizer(inner, static_loss_scale=0)
    assert inner.param_groups[0]["params"] == list(model.parameters()) and not hasattr(inner, "_ampkit")
    with pytest.raises(ValueError, match="scale_factor"):
        fu.FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), dynamic_loss_scale=True,
                          dynamic_loss_args={"scale_factor": 1.0})
    with pytest.raises(ValueError, match="scale_window"):
        fu.DynamicLossScaler(scale_window=0)
    with pytest.raises(TypeError, match="dynamic_loss_scale"):
        fu.FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), dynamic_loss_scale="yes")
    opt = fu.FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), verbose=False)
    with pytest.raises(NotImplementedError, match="closure"):
        opt.step(lambda: 0)
    with pytest.raises(RuntimeError, match="state_dict"):
        import pickle

        pickle.dumps(opt)


def test_loads_an_apex_era_checkpoint():
    """Apex pickled its scaler object into FP16_Optimizer.state_dict(); through the apex stand-in it
    unpickles as ampkit's class carrying Apex's attributes. Its scale is taken over."""
    model = _half_model()
    opt = fu.FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), dynamic_loss_scale=True, verbose=False)
    sd = opt.state_dict()
    apex_scaler = fu.DynamicLossScaler.__new__(fu.DynamicLossScaler)
    apex_scaler.__dict__.update(cur_scale=512.0, cur_iter=10, last_overflow_iter=3, scale_factor=2.0, scale_window=1000)
    sd["loss_scaler"] = apex_scaler
    opt.load_state_dict(copy.deepcopy(sd))
    assert opt.loss_scale == 512.0
    with pytest.raises(TypeError, match="loss_scaler"):
        opt.loss_scaler.load_state_dict(object())
