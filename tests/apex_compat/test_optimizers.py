"""``apex.optimizers``, ``apex.multi_tensor_apply`` and ``amp_C`` in the stand-in: Apex's fused
optimizers are torch.optim optimizers stepping exactly as torch's do, and the common amp_C
ops compute what plain torch computes, with Apex's overflow flag."""
import pytest
import torch


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _trajectory(make_optimizer, steps=5):
    """Parameters after each of ``steps`` steps of a tiny regression, from one seed."""
    model = _model()
    opt = make_optimizer(model.parameters())
    seen = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(16, 6, generator=g)
        opt.zero_grad()
        (model(x) - x.sum(1, keepdim=True)).pow(2).mean().backward()
        opt.step()
        seen.append([p.detach().clone() for p in model.parameters()])
    return seen


def _same(a, b):
    assert len(a) == len(b)
    for step_a, step_b in zip(a, b):
        for x, y in zip(step_a, step_b):
            assert x.dtype == y.dtype and torch.equal(x, y)


@pytest.mark.parametrize("apex_kw,torch_cls,torch_kw", [
    (dict(lr=1e-2, weight_decay=0.1), torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    (dict(lr=1e-2, weight_decay=0.1, adam_w_mode=False, betas=(0.8, 0.99), eps=1e-6), torch.optim.Adam,
     dict(lr=1e-2, weight_decay=0.1, betas=(0.8, 0.99), eps=1e-6)),
    (dict(lr=1e-2, amsgrad=True), torch.optim.AdamW, dict(lr=1e-2, amsgrad=True, weight_decay=0.0)),  # Apex: 0 by default
])
def test_fused_adam_steps_as_torch_adam(standin, apex_kw, torch_cls, torch_kw):
    from apex.optimizers import FusedAdam

    opt = FusedAdam(_model().parameters(), **apex_kw)
    assert isinstance(opt, torch.optim.Optimizer) and opt.param_groups[0]["fused"] is True  # CPU has fused Adam
    _same(_trajectory(lambda p: FusedAdam(p, **apex_kw)), _trajectory(lambda p: torch_cls(p, fused=True, **torch_kw)))
    changed = _trajectory(lambda p: FusedAdam(p, **dict(apex_kw, lr=2e-2)))  # the comparison can fail
    assert not torch.equal(changed[-1][0], _trajectory(lambda p: FusedAdam(p, **apex_kw))[-1][0])


def test_fused_sgd_and_adagrad_step_as_torch(standin):
    from apex.optimizers import FusedAdagrad, FusedSGD

    sgd = dict(lr=0.05, momentum=0.9, weight_decay=1e-3, nesterov=True)
    _same(_trajectory(lambda p: FusedSGD(p, **sgd)), _trajectory(lambda p: torch.optim.SGD(p, fused=True, **sgd)))
    _same(_trajectory(lambda p: FusedSGD(p, lr=0.05, dampening=0.1, momentum=0.5, materialize_master_grads=False)),
          _trajectory(lambda p: torch.optim.SGD(p, lr=0.05, dampening=0.1, momentum=0.5, fused=True)))
    _same(_trajectory(lambda p: FusedAdagrad(p, lr=0.1, weight_decay=1e-2)),
          _trajectory(lambda p: torch.optim.Adagrad(p, lr=0.1, weight_decay=1e-2, fused=True)))


def test_param_groups_generators_and_devices_without_fused_kernels(standin):
    from apex.optimizers import FusedAdam

    model = _model()
    groups = ({"params": (p for p in model[0].parameters()), "lr": 0.5}, {"params": model[2].weight})
    opt = FusedAdam(groups, lr=1e-3)
    assert [len(g["params"]) for g in opt.param_groups] == [2, 1] and [g["lr"] for g in opt.param_groups] == [0.5, 1e-3]
    meta = FusedAdam([torch.nn.Parameter(torch.empty(3, device="meta"))])  # no fused kernels there: foreach
    assert meta.param_groups[0]["foreach"] is True and not meta.param_groups[0]["fused"]


def test_zero_grad_follows_set_grad_none(standin):
    from apex.optimizers import FusedAdam, FusedSGD

    model = _model()
    model(torch.ones(2, 6)).sum().backward()
    FusedSGD(model.parameters(), lr=0.1).zero_grad()  # Apex's FusedSGD default: zeros
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    FusedSGD(model.parameters(), lr=0.1).zero_grad(set_to_none=True)
    assert all(p.grad is None for p in model.parameters())
    model(torch.ones(2, 6)).sum().backward()
    FusedAdam(model.parameters(), set_grad_none=False).zero_grad()
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    FusedAdam(model.parameters()).zero_grad()  # Apex's FusedAdam default: None
    assert all(p.grad is None for p in model.parameters())


def test_arguments_without_torch_equivalent_are_refused(standin):
    from apex.optimizers import FusedAdagrad, FusedAdam, FusedSGD

    params = list(_model().parameters())
    with pytest.raises(ValueError, match=r"FusedAdam\(bias_correction=False\).*torch.optim.AdamW"):
        FusedAdam(params, bias_correction=False)
    with pytest.raises(ValueError, match=r"FusedAdam\(master_weights=True\).*opt_level='O2'"):
        FusedAdam(params, master_weights=True, capturable=True)
    with pytest.raises(ValueError, match=r"FusedSGD\(wd_after_momentum=True\).*=False \(torch.optim.SGD\)"):
        FusedSGD([{"params": params[:2]}, {"params": params[2:], "weight_decay": 1e-4}], lr=0.1, wd_after_momentum=True)
    assert FusedSGD(params, lr=0.1, wd_after_momentum=True).wd_after_momentum  # no weight decay: same update
    with pytest.raises(ValueError, match=r"FusedAdagrad\(adagrad_w_mode=True\).*torch.optim.Adagrad"):
        FusedAdagrad(params, weight_decay=0.1, adagrad_w_mode=True)
    with pytest.raises(ValueError, match="no lr given"):
        FusedSGD(params)  # Apex's FusedSGD needs lr too (from the optimizer or from every group): a ValueError there


def test_optimizers_without_torch_equivalent_fail_when_created(standin):
    from apex.optimizers import FusedLAMB, FusedMixedPrecisionLamb, FusedNovoGrad  # importing them works
    from apex.optimizers.fused_lamb import FusedLAMB as lamb_again

    assert lamb_again is FusedLAMB
    params = list(_model().parameters())
    for cls, what in [(FusedLAMB, "no LAMB"), (FusedMixedPrecisionLamb, "no LAMB"), (FusedNovoGrad, "no NovoGrad")]:
        with pytest.raises(NotImplementedError, match=rf"apex.optimizers.{cls.__name__} .*{what}.*torch.optim.AdamW"):
            cls(params, lr=1e-3)


def _flag():
    return torch.zeros(1, dtype=torch.int)


def _tensors():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(7, generator=g).half(), torch.randn(3, 5, generator=g), torch.randn(1, generator=g).bfloat16()]


def test_multi_tensor_scale(standin):
    import amp_C
    from apex.multi_tensor_apply import multi_tensor_applier

    ins = _tensors()
    outs = [torch.empty(7), torch.empty(3, 5).half(), torch.empty(1)]
    flag = _flag()
    multi_tensor_applier(amp_C.multi_tensor_scale, flag, [ins, outs], 0.125)
    assert flag.item() == 0 and [o.dtype for o in outs] == [torch.float32, torch.float16, torch.float32]
    for i, o in zip(ins, outs):
        assert torch.equal(o, (i.float() * 0.125).to(o.dtype))
    for where in (0, 2, -1):  # a non-finite input anywhere sets the flag; values propagate
        ins[1].view(-1)[where] = float("inf") if where else float("nan")
        flag = _flag()
        multi_tensor_applier(amp_C.multi_tensor_scale, flag, [ins, outs], 0.5)
        assert flag.item() == 1 and not torch.isfinite(outs[1]).all()
        ins[1].view(-1)[where] = 1.0
    multi_tensor_applier(amp_C.multi_tensor_scale, flag, [ins, outs], 0.5)
    assert flag.item() == 1  # the flag is only ever set, never cleared (as Apex's)


def test_multi_tensor_axpby(standin):
    import amp_C
    from apex.multi_tensor_apply import multi_tensor_applier

    xs, ys = _tensors(), [t.float() * 3 for t in _tensors()]
    outs = [torch.empty_like(x) for x in xs]
    flag = _flag()
    multi_tensor_applier(amp_C.multi_tensor_axpby, flag, [xs, ys, outs], 2.0, -0.5, -1)
    assert flag.item() == 0
    for x, y, o in zip(xs, ys, outs):
        assert o.dtype == x.dtype and torch.equal(o, (2.0 * x.float() + -0.5 * y).to(x.dtype))
    ys[0][3] = float("inf")
    for arg_to_check, flagged in [(0, 0), (1, 1), (-1, 1)]:
        flag = _flag()
        multi_tensor_applier(amp_C.multi_tensor_axpby, flag, [xs, ys, outs], 2.0, -0.5, arg_to_check)
        assert flag.item() == flagged and outs[0][3].item() == float("-inf")
    with pytest.raises(ValueError, match=r"arg_to_check=2\).*expected -1"):
        multi_tensor_applier(amp_C.multi_tensor_axpby, flag, [xs, ys, outs], 2.0, -0.5, 2)


def test_multi_tensor_l2norm(standin):
    import amp_C
    from apex.multi_tensor_apply import multi_tensor_applier

    ts = _tensors()
    flag = _flag()
    total, per = multi_tensor_applier(amp_C.multi_tensor_l2norm, flag, [ts], False)
    expected = torch.linalg.vector_norm(torch.cat([t.float().flatten() for t in ts]))
    assert total.shape == (1,) and total.dtype == torch.float32 and per.shape == (0,) and flag.item() == 0
    torch.testing.assert_close(total[0], expected, rtol=1e-6, atol=0)
    total2, per = multi_tensor_applier(amp_C.multi_tensor_l2norm, flag, [ts], True)
    assert torch.equal(total2, total) and per.dtype == torch.float32
    assert torch.equal(per, torch.stack([torch.linalg.vector_norm(t.float()) for t in ts]))
    ts[2][0] = float("inf")
    total, per = multi_tensor_applier(amp_C.multi_tensor_l2norm, flag, [ts], True)
    assert flag.item() == 1 and total.item() == float("inf")
    assert per[2].item() == float("inf") and torch.isfinite(per[:2]).all()
    with pytest.raises(ValueError, match=r"tensor_lists\[0\] is empty"):
        multi_tensor_applier(amp_C.multi_tensor_l2norm, flag, [[]], False)


def test_applier_and_other_amp_c_ops(standin):
    import amp_C
    from apex.multi_tensor_apply import MultiTensorApply, multi_tensor_applier

    assert multi_tensor_applier.available and isinstance(multi_tensor_applier, MultiTensorApply)
    seen = []
    assert MultiTensorApply(64)(lambda *a: seen.append(a) or "out", "flag", [[1]], 3) == "out"
    assert seen == [(64, "flag", [[1]], 3)] and multi_tensor_applier.chunk_size == 2048 * 32
    with pytest.raises(NotImplementedError, match=r"amp_C.multi_tensor_adam is not .*AdamW/Adam\(params, fused=True\)"):
        amp_C.multi_tensor_adam(2048, _flag(), [[]], 1e-3)
    with pytest.raises(NotImplementedError, match="amp_C.multi_tensor_lamb .*no LAMB"):
        amp_C.multi_tensor_lamb()


def test_fused_sgd_takes_its_lr_from_the_parameter_groups_as_apex_does(standin):
    """Apex's signature is ``FusedSGD(params, lr=required, ...)``: per-group lr is enough."""
    from apex.optimizers import FusedSGD

    def groups(p):
        p = list(p)
        return [{"params": p[:2], "lr": 0.05}, {"params": p[2:], "lr": 0.01}]

    _same(_trajectory(lambda p: FusedSGD(groups(p), momentum=0.9)),
          _trajectory(lambda p: torch.optim.SGD(groups(p), momentum=0.9, fused=True)))
    opt = FusedSGD(groups(_model().parameters()))
    assert [g["lr"] for g in opt.param_groups] == [0.05, 0.01]
    with pytest.raises(ValueError, match=r"required optimization parameter lr"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
    opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "lr": 0.2})
    assert opt.param_groups[-1]["lr"] == 0.2
    for params in (_model().parameters(), [{"params": list(_model().parameters()), "lr": 0.1},
                                            {"params": [torch.nn.Parameter(torch.zeros(2))]}]):
        with pytest.raises(ValueError, match=r"FusedSGD: no lr given and parameter group \d has none; pass lr=\.\.\."):
            FusedSGD(params, momentum=0.9)
    assert FusedSGD(_model().parameters(), lr=0.3).param_groups[0]["lr"] == 0.3
