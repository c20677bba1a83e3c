"""ampkit.parallel.SyncBatchNorm: equal to one BatchNorm over the union of every rank's batch.

Each case runs a few training steps on 2 (or 3) gloo ranks, with equal or unequal (even
empty) per-rank batches, and is compared with a plain BatchNorm over the concatenated
batch: outputs, input gradients, affine gradients (summed over ranks, as DDP would),
running statistics and the eval-mode output.
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ampkit.parallel import SyncBatchNorm, convert_syncbn_model, create_syncbn_process_group
from ampkit._parallel.sync_batchnorm import _SyncBatchNormFunction

from ._launch import run

F16, B16, F32 = torch.float16, torch.bfloat16, torch.float32
CL = torch.channels_last
TWO = {  # name: per-rank batch sizes, trailing shape, options
    "bn2d": dict(sizes=[3, 3], tail=(3, 2, 2)),
    "unequal": dict(sizes=[1, 4], tail=(3, 2, 2)),
    "bn1d_2d_input": dict(sizes=[2, 5], tail=(3,)),
    "bn1d_3d_input": dict(sizes=[2, 3], tail=(3, 4)),
    "bn3d": dict(sizes=[2, 1], tail=(3, 2, 2, 2)),
    "fp16_input": dict(sizes=[3, 2], tail=(3, 2, 2), dtype=F16),
    "bf16_input": dict(sizes=[3, 2], tail=(3, 2, 2), dtype=B16),
    "fp16_params": dict(sizes=[2, 3], tail=(3, 2, 2), dtype=F16, param_dtype=F16),
    "channel_last": dict(sizes=[2, 3], tail=(3, 2, 2), options={"channel_last": True}),
    "channels_last_input": dict(sizes=[2, 3], tail=(3, 2, 2), memory_format=CL),
    "cumulative_average": dict(sizes=[2, 3], tail=(3,), options={"momentum": None}),
    "no_affine": dict(sizes=[2, 3], tail=(3,), options={"affine": False}),
    "no_running_stats": dict(sizes=[2, 3], tail=(3,), options={"track_running_stats": False}),
    "group_of_two": dict(sizes=[2, 3], tail=(3,), group_size=2),
    "groups_of_one": dict(sizes=[2, 3], tail=(3,), group_size=1),
}
THREE = {
    "unequal": dict(sizes=[1, 2, 4], tail=(3, 2, 2)),
    "empty_rank": dict(sizes=[0, 3, 2], tail=(3,)),
    "bf16_unequal": dict(sizes=[2, 1, 3], tail=(3, 2, 2), dtype=B16),
    "group_of_three": dict(sizes=[1, 1, 2], tail=(3,), group_size=3),
}
STEPS = 2
TOLERANCE = {F32: dict(rtol=1e-5, atol=1e-5), F16: dict(rtol=2e-3, atol=2e-3), B16: dict(rtol=2e-2, atol=2e-2)}


def _data(case, step):
    """Global input and upstream gradient of one step (mean and scale away from 0 and 1)."""
    g = torch.Generator().manual_seed(100 + step)
    shape = (sum(case["sizes"]),) + case["tail"]
    x = 3.0 + 2.0 * torch.randn(shape, generator=g)
    return x.to(case.get("dtype", F32)), torch.randn(shape, generator=g).to(case.get("dtype", F32))


def _bounds(case, rank):
    start = sum(case["sizes"][:rank])
    return start, start + case["sizes"][rank]


def _init(bn, case):
    if bn.affine:
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            bn.weight.copy_(1 + 0.1 * torch.randn(3, generator=g))
            bn.bias.copy_(0.1 * torch.randn(3, generator=g))
    return bn.to(case.get("param_dtype", F32))


def _run(bn, case, slicer):
    """STEPS training steps then an eval forward; what each rank (or the reference) saw."""
    out = {}
    for step in range(STEPS):
        x, dy = (slicer(t) for t in _data(case, step))
        x = x.contiguous(memory_format=case["memory_format"]) if "memory_format" in case else x
        x.requires_grad_(True)
        bn.zero_grad()
        y = bn(x)
        y.backward(dy)
        out.update(y=y.detach(), dx=x.grad, channels_last=y.dim() == 4 and y.is_contiguous(memory_format=CL))
    out["affine_grads"] = [p.grad for p in bn.parameters()]
    out["buffers"] = {k: v.clone() for k, v in bn.named_buffers()}
    bn.eval()
    out["eval"] = bn(slicer(_data(case, STEPS)[0]))
    return out


def _worker(rank, world_size, cases):
    out = {}
    for name, case in cases.items():
        group = create_syncbn_process_group(case["group_size"]) if "group_size" in case else None
        bn = _init(SyncBatchNorm(3, process_group=group, **case.get("options", {})), case)
        lo, hi = _bounds(case, rank)
        out[name] = _run(bn, case, lambda t: t[lo:hi])
    out["bad_group_sizes"] = _bad_group_sizes() if world_size == 3 else None
    return out


def _reference(case, lo=0, hi=None):
    bn_class = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}[1 + len(case["tail"])]
    options = {k: v for k, v in case.get("options", {}).items() if k != "channel_last"}
    return _run(_init(bn_class(3, **options), case), case, lambda t: t[lo:hi])


def _check(results, name, case):
    """Rank slices of the whole-batch reference; per-rank references where nothing is shared."""
    tol = TOLERANCE[case.get("dtype", F32)]
    local = case.get("group_size") == 1
    # Eval mode never synchronises: without running statistics it normalises by the local batch.
    local_eval = local or not case.get("options", {}).get("track_running_stats", True)
    whole = _reference(case)
    for rank, got in enumerate(r[name] for r in results):
        lo, hi = _bounds(case, rank)
        mine = _reference(case, lo, hi) if local_eval else None
        want = {"y": mine["y"], "dx": mine["dx"]} if local else {"y": whole["y"][lo:hi], "dx": whole["dx"][lo:hi]}
        want["eval"] = mine["eval"] if local_eval else whole["eval"][lo:hi]
        for key, value in want.items():
            assert got[key].dtype == value.dtype, key
            torch.testing.assert_close(got[key].float(), value.float(), **tol, msg=f"{name}: {key}")
        for key, value in (mine if local else whole)["buffers"].items():
            torch.testing.assert_close(got["buffers"][key], value, **tol, msg=f"{name}: {key}")
            assert torch.equal(got["buffers"][key], results[0][name]["buffers"][key]) or local, f"{name}: ranks' {key} differ"
        if local:
            for g, w in zip(got["affine_grads"], mine["affine_grads"]):
                torch.testing.assert_close(g.float(), w.float(), **tol)
    if not local:
        summed = [sum(r[name]["affine_grads"][i].float() for r in results) for i in range(len(whole["affine_grads"]))]
        for g, w in zip(summed, whole["affine_grads"]):
            torch.testing.assert_close(g, w.float(), **tol, msg=f"{name}: affine grads")


@pytest.fixture(scope="module")
def two_ranks():
    return run(_worker, 2, TWO)


@pytest.fixture(scope="module")
def three_ranks():
    return run(_worker, 3, THREE)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TWO))
def test_two_ranks_equal_one_batchnorm(two_ranks, name):
    _check(two_ranks, name, TWO[name])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(THREE))
def test_three_ranks_equal_one_batchnorm(three_ranks, name):
    _check(three_ranks, name, THREE[name])


@pytest.mark.slow
def test_channel_last_output_is_channels_last(two_ranks):
    assert all(r["channel_last"]["channels_last"] for r in two_ranks)
    assert all(r["channels_last_input"]["channels_last"] for r in two_ranks)
    assert not any(r["bn2d"]["channels_last"] for r in two_ranks)


def _bad_group_sizes():
    errors = []
    for size in (2, 4, -1):
        try:
            create_syncbn_process_group(size)
        except ValueError as e:
            errors.append(str(e))
    return errors


@pytest.mark.slow
def test_create_syncbn_process_group_checks_division(three_ranks):
    errors = three_ranks[0]["bad_group_sizes"]
    assert len(errors) == 3
    assert "world size 3 must be a multiple of group_size" in errors[0]


# --- one process ----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [F32, F16, B16])
def test_without_process_group_is_batchnorm(dtype):
    sync, plain = SyncBatchNorm(3), nn.BatchNorm2d(3)
    x = torch.randn(4, 3, 2, 2).to(dtype)
    for mode in (True, False):
        sync.train(mode)
        plain.train(mode)
        y = sync(x)
        assert y.dtype == dtype
        assert torch.equal(y, plain(x))
    assert torch.equal(sync.running_var, plain.running_var)


@pytest.fixture
def world_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_world_of_one_is_batchnorm(world_of_one):
    sync, plain = SyncBatchNorm(3), nn.BatchNorm1d(3)
    x = torch.randn(5, 3)
    assert torch.equal(sync(x), plain(x))


def test_statistics_exchange_matches_batch_norm_and_gradcheck(world_of_one):
    x = (3 + torch.randn(4, 3, 2, dtype=torch.float64)).requires_grad_()
    w = torch.rand(3, dtype=torch.float64).add_(0.5).requires_grad_()
    b = torch.randn(3, dtype=torch.float64, requires_grad=True)
    rm, rv = torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
    rm_ref, rv_ref = rm.clone(), rv.clone()
    y = _SyncBatchNormFunction.apply(x, w, b, rm, rv, 1e-5, 0.1, world_of_one, 1)
    torch.testing.assert_close(y, F.batch_norm(x, rm_ref, rv_ref, w, b, True, 0.1, 1e-5))
    torch.testing.assert_close((rm, rv), (rm_ref, rv_ref))
    fn = lambda x, w, b: _SyncBatchNormFunction.apply(x, w, b, None, None, 1e-5, 0.1, world_of_one, 1)
    assert torch.autograd.gradcheck(fn, (x, w, b))


def test_rejects_wrong_channel_dim():
    with pytest.raises(ValueError, match="channels are dim 1"):
        SyncBatchNorm(3)(torch.randn(2, 4, 4, 3))


class _WithNorms(nn.Module):
    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm2d(3)
        self.inner = nn.Sequential(nn.Conv1d(3, 3, 1), nn.BatchNorm1d(3, affine=False, momentum=0.3))
        self.inorm = nn.InstanceNorm2d(3, affine=True)
        self.nobias = nn.BatchNorm1d(3, bias=False)


def test_convert_syncbn_model_keeps_parameters_and_statistics():
    model = _WithNorms()
    model.bn.running_mean.fill_(0.5)
    model.bn.num_batches_tracked.fill_(7)
    model.inner[1].eval()
    before = dict(model.named_modules())
    tensors = {k: v for k, v in list(model.named_parameters()) + list(model.named_buffers())}
    group = object()
    out = convert_syncbn_model(model, process_group=group, channel_last=True)
    assert out is model
    for name in ("bn", "inner.1", "nobias"):
        m = out.get_submodule(name)
        old = before[name]
        assert type(m) is SyncBatchNorm and m.process_group is group and m.channel_last
        assert (m.eps, m.momentum, m.affine, m.track_running_stats, m.training) == (
            old.eps, old.momentum, old.affine, old.track_running_stats, old.training)
    assert out.inorm is before["inorm"] and out.inner[0] is before["inner.0"]
    assert out.nobias.bias is None
    after = {k: v for k, v in list(out.named_parameters()) + list(out.named_buffers())}
    assert after.keys() == tensors.keys()
    assert all(after[k] is tensors[k] for k in tensors)


def test_convert_syncbn_model_on_a_bare_batchnorm():
    bn = nn.BatchNorm1d(4)
    sync = convert_syncbn_model(bn)
    assert isinstance(sync, SyncBatchNorm) and sync.weight is bn.weight and sync.running_var is bn.running_var


def test_create_syncbn_process_group_zero_is_world():
    assert create_syncbn_process_group(0) is None
    with pytest.raises(ValueError, match="expected an integer"):
        create_syncbn_process_group(1.5)
