"""ampkit.parallel.DistributedDataParallel: Apex's options on torch DDP, on real gloo processes.

One spawn of 2 ranks and one of 3 run every scenario; each is compared with a
single-process run on the concatenated batch (the BatchNorm there is a plain one over
the whole batch, the DDP model's is a SyncBatchNorm), and ranks must agree bit for bit.
"""
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ampkit._common.errors import NoEffectWarning
from ampkit.parallel import DistributedDataParallel, convert_syncbn_model
from ampkit._parallel import distributed as ddp_impl

from ._launch import run
from ._models import Net, batches, make_net, params, shard

LR = 0.1
F16, B16, F32 = torch.float16, torch.bfloat16, torch.float32
SCENARIOS = {  # name: (parameter dtype, DDP kwargs)
    "fp32": (F32, {}),
    "fp16": (F16, {}),
    "bf16": (B16, {}),
    "fp16_fp32_allreduce": (F16, {"allreduce_always_fp32": True}),
    "bf16_fp32_allreduce": (B16, {"allreduce_always_fp32": True}),
    "predivide": (F32, {"gradient_predivide_factor": 2.0}),
    "predivide_fp16": (F16, {"gradient_predivide_factor": 4.0}),
    "delay": (F32, {"delay_allreduce": True}),
    "delay_bf16": (B16, {"delay_allreduce": True}),
    "small_buckets": (F32, {"message_size": 8}),
    "retain": (F32, {"retain_allreduce_buffers": True}),
    "sum": (F32, {"gradient_average": False}),
}
THREE_RANKS = ["fp32", "bf16", "predivide", "delay"]
TOLERANCE = {F32: dict(rtol=1e-5, atol=1e-6), F16: dict(rtol=1e-3, atol=5e-4), B16: dict(rtol=4e-3, atol=2e-3)}


def _train(model, data, dtype, lr):
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for x, y in data:
        opt.zero_grad()
        F.mse_loss(model(x.to(dtype)).float(), y).backward()
        opt.step()
    return params(model)


def _lr(kwargs, world_size):
    # gradient_average=False sums gradients: the same update as world_size x the lr on the mean.
    return LR if kwargs.get("gradient_average", True) else LR / world_size


def _comm_during_backward(ddp, x):
    """For each gradient as it lands in backward: had an all_reduce already been issued?"""
    calls, seen = [0], []
    hooks = [p.register_post_accumulate_grad_hook(lambda p: seen.append(calls[0] > 0)) for p in ddp.parameters()]
    real = dist.all_reduce

    def counting(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    dist.all_reduce = counting
    try:
        ddp(x).sum().backward()
    finally:
        dist.all_reduce = real
        for h in hooks:
            h.remove()
    return seen, calls[0]


def _worker(rank, world_size, names, extras):
    out = {}
    for name in names:
        dtype, kwargs = SCENARIOS[name]
        # Each rank starts from different weights: construction must broadcast rank 0's.
        ddp = DistributedDataParallel(convert_syncbn_model(make_net(seed=rank, dtype=dtype)), **kwargs)
        initial = params(ddp)
        data = [shard(b, rank, world_size) for b in batches(world_size)]
        out[name] = {"initial": initial, "final": _train(ddp, data, dtype, _lr(kwargs, world_size))}
        if name == "retain":
            out[name]["grad_storages"] = len({p.grad.untyped_storage().data_ptr() for p in ddp.parameters()})
    if not extras:
        return out
    # Overlap: with small buckets, reduction starts while backward runs; delayed, only after it.
    x = shard(batches(world_size)[0], rank, world_size)[0]
    for delay in (False, True):
        torch.manual_seed(0)
        ddp = DistributedDataParallel(Net(norm=lambda n: nn.Identity()), message_size=8, delay_allreduce=delay)
        ddp(x).sum().backward()  # the first backward settles torch's bucket order
        out[f"overlap_delay={delay}"] = _comm_during_backward(ddp, x)
    out["accumulate"] = _accumulate(rank, world_size)
    return out


def _accumulate(rank, world_size):
    """Two micro-batches per step; the first backward with allreduce disabled."""
    ddp = DistributedDataParallel(convert_syncbn_model(make_net()))
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    local_grads_differ = []
    for i, (x, y) in enumerate(shard(b, rank, world_size) for b in batches(world_size, steps=4)):
        first = i % 2 == 0
        if first:
            opt.zero_grad()
            ddp.disable_allreduce()
        F.mse_loss(ddp(x), y).backward()
        grads = torch.cat([p.grad.flatten() for p in ddp.parameters()])
        gathered = [torch.empty_like(grads) for _ in range(world_size)]
        dist.all_gather(gathered, grads)
        local_grads_differ.append(not torch.equal(gathered[0], gathered[1]))
        if first:
            ddp.enable_allreduce()
        else:
            opt.step()
    return {"final": params(ddp), "local_grads_differ": local_grads_differ}


def _reference(name, world_size):
    dtype = SCENARIOS[name][0]
    return _train(make_net(dtype=dtype), batches(world_size), dtype, LR)


@pytest.fixture(scope="module")
def two_ranks():
    return run(_worker, 2, list(SCENARIOS), True)


@pytest.fixture(scope="module")
def three_ranks():
    return run(_worker, 3, THREE_RANKS, False)


def _check_scenario(results, name):
    world_size = len(results)
    dtype = SCENARIOS[name][0]
    expected_initial = params(make_net(seed=0, dtype=dtype))
    reference = _reference(name, world_size)
    for r in results:
        for got, want in zip(r[name]["initial"], expected_initial):
            assert torch.equal(got, want), "parameters were not broadcast from rank 0"
        for a, b in zip(r[name]["final"], results[0][name]["final"]):
            assert torch.equal(a, b), f"{name}: ranks diverged"
    for got, want in zip(results[0][name]["final"], reference):
        torch.testing.assert_close(got, want, **TOLERANCE[dtype])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_two_ranks_match_single_process(two_ranks, name):
    _check_scenario(two_ranks, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", THREE_RANKS)
def test_three_ranks_match_single_process(three_ranks, name):
    _check_scenario(three_ranks, name)


@pytest.mark.slow
def test_options_give_the_same_update(two_ranks):
    base = {F32: two_ranks[0]["fp32"]["final"], F16: two_ranks[0]["fp16"]["final"], B16: two_ranks[0]["bf16"]["final"]}
    for name, (dtype, _) in SCENARIOS.items():
        for got, want in zip(two_ranks[0][name]["final"], base[dtype]):
            torch.testing.assert_close(got, want, **TOLERANCE[dtype])
    # With two ranks, bucketing and (for 2 = predivide factor) pre-division change nothing.
    for name in ("small_buckets", "retain", "delay", "predivide", "sum"):
        assert all(torch.equal(a, b) for a, b in zip(two_ranks[0][name]["final"], base[F32])), name


@pytest.mark.slow
def test_retain_allreduce_buffers_makes_grads_bucket_views(two_ranks):
    assert two_ranks[0]["retain"]["grad_storages"] == 1


@pytest.mark.slow
def test_delay_allreduce_communicates_only_after_backward(two_ranks):
    for r in two_ranks:
        overlapped, calls = r["overlap_delay=False"]
        assert calls > 1 and any(overlapped)
        delayed, calls = r["overlap_delay=True"]
        assert calls == 1 and not any(delayed)


@pytest.mark.slow
def test_disable_allreduce_accumulates_locally(two_ranks):
    a, b = (r["accumulate"] for r in two_ranks)
    assert a["local_grads_differ"] == [True, False, True, False]
    assert all(torch.equal(x, y) for x, y in zip(a["final"], b["final"]))
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    data = batches(2, steps=4)
    for i in (0, 2):
        opt.zero_grad()
        for x, y in data[i:i + 2]:
            F.mse_loss(net(x), y).backward()
        opt.step()
    for got, want in zip(a["final"], params(net)):
        torch.testing.assert_close(got, want, **TOLERANCE[F32])


# --- single process: construction, validation, reporting (a world of one rank) ---------

@pytest.fixture
def world_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_requires_initialized_process_group(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    with pytest.raises(RuntimeError, match="init_process_group"):
        DistributedDataParallel(make_net())


@pytest.mark.parametrize("kwargs, match", [
    ({"shared_param": object()}, "shared_param is no longer supported"),
    ({"delay_allreduce": True, "num_allreduce_streams": 2}, "only be used if delay_allreduce=False"),
    ({"delay_allreduce": True, "allreduce_trigger_params": []}, "only valid if delay_allreduce=False"),
    ({"allreduce_communicators": ([None], [None])}, "allreduce_communicators"),
    ({"num_allreduce_streams": 0}, "num_allreduce_streams"),
    ({"message_size": 0}, "message_size"),
    ({"gradient_predivide_factor": 0.0}, "gradient_predivide_factor"),
])
def test_invalid_options(world_of_one, kwargs, match):
    with pytest.raises(ValueError, match=match):
        DistributedDataParallel(make_net(), **kwargs)


def test_options_without_effect_are_reported_once(world_of_one, monkeypatch):
    monkeypatch.setattr(ddp_impl, "_reported", set())
    net = make_net()
    kwargs = dict(allreduce_trigger_params=[net.fc1.weight], num_allreduce_streams=2, gradient_average_split_factor=2.0, prof=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        DistributedDataParallel(net, **kwargs)
        DistributedDataParallel(make_net(), **kwargs)
        DistributedDataParallel(make_net())
    reported = [str(w.message) for w in caught if issubclass(w.category, NoEffectWarning)]
    assert len(reported) == 4
    for name in ("allreduce_trigger_params", "num_allreduce_streams", "gradient_average_split_factor", "prof"):
        assert sum(m.startswith(f"DistributedDataParallel({name}=") for m in reported) == 1
    assert not [w for w in caught if not issubclass(w.category, NoEffectWarning)]


def test_module_forward_and_state_dict_as_apex(world_of_one):
    net = make_net()
    ddp = DistributedDataParallel(net)
    x = torch.randn(5, 4)
    assert ddp.module is net
    assert torch.equal(ddp(x), net(x))
    assert list(ddp.state_dict()) == ["module." + k for k in net.state_dict()]
    ddp.disable_allreduce()
    assert not ddp.require_backward_grad_sync
    ddp.enable_allreduce()
    assert ddp.require_backward_grad_sync


def test_bucket_size_is_message_size_elements(world_of_one):
    assert DistributedDataParallel(make_net(), message_size=1000).bucket_bytes_cap == 4000
    # Half linear layers hold most elements (the BatchNorm stays float32): 2 bytes each.
    assert DistributedDataParallel(make_net(dtype=F16), message_size=1000).bucket_bytes_cap == 2000
    assert DistributedDataParallel(make_net()).bucket_bytes_cap == 40_000_000


def test_torch_ddp_options_pass_through(world_of_one):
    ddp = DistributedDataParallel(make_net(), find_unused_parameters=True, gradient_as_bucket_view=True, bucket_cap_mb=1)
    assert ddp.find_unused_parameters and ddp.gradient_as_bucket_view and ddp.bucket_bytes_cap == 2**20
    assert DistributedDataParallel(make_net(), static_graph=True).static_graph
    assert DistributedDataParallel(make_net(), retain_allreduce_buffers=True).gradient_as_bucket_view
    sync = next(iter(ddp_impl._NO_BUFFER_SYNC))  # forward_sync_buffers (torch >= 2.13) or broadcast_buffers
    assert getattr(DistributedDataParallel(make_net(), **{sync: True}), sync) is True
    plain = DistributedDataParallel(make_net())  # Apex's defaults
    assert getattr(plain, sync) is False and not plain.find_unused_parameters and not plain.gradient_as_bucket_view


@pytest.mark.parametrize("kwargs, error, match", [
    ({"find_unused_parameter": True}, TypeError, r"find_unused_parameter=\.\.\.\): no such argument.*find_unused_parameters"),
    ({"bucket_cap_mb": 1, "message_size": 1000}, ValueError, r"bucket_cap_mb=1, message_size=1000\): both set"),
    ({"bucket_cap_mb": 1, "delay_allreduce": True}, ValueError, r"bucket_cap_mb=1, delay_allreduce=True\): both set"),
    ({"retain_allreduce_buffers": True, "gradient_as_bucket_view": False}, ValueError, "two values"),
    ({"mixed_precision": object()}, ValueError, r"mixed_precision=\.\.\.\): ampkit does the mixed precision.*None"),
])
def test_torch_ddp_options_that_do_not_exist_or_conflict_with_apexs_are_refused(world_of_one, kwargs, error, match):
    with pytest.raises(error, match=match):
        DistributedDataParallel(make_net(), **kwargs)
