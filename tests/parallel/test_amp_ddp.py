"""ampkit.initialize + scale_loss on 2 gloo ranks, at every opt level.

Against a single-process run on the concatenated batch (plain BatchNorm there,
SyncBatchNorm in the DDP model): parameters and fp32 masters match, and are bit-identical
across ranks; an inf on one rank only makes every rank skip the same step; a checkpoint
written on rank 0 resumes bit-identically to an uninterrupted run.
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import ampkit
from ampkit.parallel import DistributedDataParallel, convert_syncbn_model

from ._launch import run
from ._models import batches, make_net, shard

LEVELS = ["O0", "O1", "O2", "O3", "O4", "O5"]
WRAPPED_BY_INITIALIZE = {"O1", "O3", "O5"}  # initialize(ddp=True); the others wrap by hand
POISON_STEP, STEPS = 2, 4
TOLERANCE = {"O0": dict(rtol=1e-5, atol=1e-6), "O1": dict(rtol=1e-3, atol=1e-3), "O2": dict(rtol=1e-3, atol=1e-3),
             "O3": dict(rtol=1e-3, atol=1e-3), "O4": dict(rtol=4e-3, atol=4e-3), "O5": dict(rtol=4e-3, atol=4e-3)}
# scenario: (levels, how a step runs, where the inf goes: None, "hook" (before the
# allreduce, via a tensor hook) or "grad" (after it, into one rank's reduced gradient))
SCENARIOS = {"train": (LEVELS, "plain", None), "inf_hook": (LEVELS, "plain", "hook"), "inf_grad": (LEVELS, "plain", "grad"),
             "two_losses": (["O1", "O2"], "two_losses", "grad"), "delay_unscale": (["O2", "O5"], "delay_unscale", "grad")}


def _bare(model):
    return model.module if isinstance(model, DistributedDataParallel) else model


def _build(level, seed, distributed, num_losses=1):
    net = make_net(seed=seed)
    if distributed:
        net = convert_syncbn_model(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    by_initialize = distributed and level in WRAPPED_BY_INITIALIZE
    # The allreduce sums the ranks' scaled float16 gradients before averaging (Apex's order),
    # so a large scale could overflow there and not in the single process: cap it at 2**10.
    model, opt = ampkit.initialize(net, opt, opt_level=level, verbosity=0, max_loss_scale=2.0**10,
                                   num_losses=num_losses, ddp=by_initialize)
    if distributed and not by_initialize:
        model = DistributedDataParallel(model)
    return model, opt


def _data(rank=None, world_size=2):
    """Per step, two micro-batches (used together, or one after the other)."""
    micro = batches(world_size, steps=2 * STEPS)
    if rank is not None:
        micro = [shard(b, rank, world_size) for b in micro]
    return [micro[2 * i: 2 * i + 2] for i in range(STEPS)]


def _train(model, opt, data, steps, how="plain", poison=None, poisoned=False):
    bare = _bare(model)
    step = [None]
    if poison == "hook" and poisoned:
        bare.fc2.weight.register_hook(lambda g: torch.full_like(g, float("inf")) if step[0] == POISON_STEP else g)

    def after_backward():
        if poison == "grad" and poisoned and step[0] == POISON_STEP:
            bare.fc2.weight.grad.view(-1)[0] = float("inf")

    for step[0] in steps:
        (x1, y1), (x2, y2) = data[step[0]]
        opt.zero_grad()
        if how == "plain":
            with ampkit.scale_loss(F.mse_loss(model(torch.cat([x1, x2])), torch.cat([y1, y2])), opt) as loss:
                loss.backward()
                after_backward()
        elif how == "two_losses":
            with ampkit.scale_loss(F.mse_loss(model(x1), y1), opt, loss_id=0) as loss:
                loss.backward()
            with ampkit.scale_loss(0.1 * model(x2).pow(2).mean(), opt, loss_id=1) as loss:
                loss.backward()
                after_backward()
        else:  # delay_unscale: accumulate two micro-batches, reducing once
            if model is not bare:
                model.disable_allreduce()
            with ampkit.scale_loss(F.mse_loss(model(x1), y1), opt, delay_unscale=True) as loss:
                loss.backward()
            if model is not bare:
                model.enable_allreduce()
            with ampkit.scale_loss(F.mse_loss(model(x2), y2), opt) as loss:
                loss.backward()
                after_backward()
        opt.step()


def _snapshot(model, opt):
    bare = _bare(model)
    return {
        "params": [p.detach().clone() for p in bare.parameters()],
        "masters": [m.detach().clone() for m in ampkit.master_params(opt)],
        "buffers": [b.clone() for b in bare.buffers()],
        "amp": ampkit.state_dict(optimizer=opt),
    }


def _worker(rank, world_size, checkpoint_dir):
    out, data = {}, _data(rank, world_size)
    for name, (levels, how, poison) in SCENARIOS.items():
        for level in levels:
            # Ranks start from different weights: DDP broadcasts rank 0's (masters too).
            model, opt = _build(level, seed=rank, distributed=True, num_losses=2 if how == "two_losses" else 1)
            _train(model, opt, data, range(STEPS), how, poison, poisoned=rank == 1)
            out[f"{level}/{name}"] = _snapshot(model, opt)
            out[f"{level}/fp32_allreduce"] = model._comm_hooks[0][1].fp32  # the comm hook's state
    for level in LEVELS:
        out[f"{level}/resume"] = _resume(rank, level, data, f"{checkpoint_dir}/{level}.pt")
    return out


def _resume(rank, level, data, path):
    """Two steps, a checkpoint from rank 0, fresh objects on every rank, two more steps."""
    model, opt = _build(level, seed=rank, distributed=True)
    _train(model, opt, data, range(2))
    if rank == 0:
        torch.save({"model": _bare(model).state_dict(), "optimizer": opt.state_dict(), "amp": ampkit.state_dict(optimizer=opt)}, path)
    dist.barrier()
    model, opt = _build(level, seed=100 + rank, distributed=True)
    checkpoint = torch.load(path, weights_only=True)
    _bare(model).load_state_dict(checkpoint["model"])
    opt.load_state_dict(checkpoint["optimizer"])
    ampkit.load_state_dict(checkpoint["amp"], optimizer=opt)
    _train(model, opt, data, range(2, STEPS))
    return _snapshot(model, opt)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run(_worker, 2, str(tmp_path_factory.mktemp("checkpoints")), timeout=600)


def _reference(level, name):
    levels, how, poison = SCENARIOS[name]
    model, opt = _build(level, seed=0, distributed=False, num_losses=2 if how == "two_losses" else 1)
    _train(model, opt, _data(), range(STEPS), how, poison, poisoned=True)
    return _snapshot(model, opt)


def _assert_identical(a, b, what):
    for key in ("params", "masters", "buffers"):
        for x, y in zip(a[key], b[key]):
            assert torch.equal(x, y), f"{what}: {key} differ"
    assert a["amp"] == b["amp"], what


CASES = [(level, name) for name, (levels, _, _) in SCENARIOS.items() for level in levels]


@pytest.mark.slow
@pytest.mark.parametrize("level, name", CASES, ids=[f"{lv}-{n}" for lv, n in CASES])
def test_matches_single_process_and_ranks_agree(two_ranks, level, name):
    key = f"{level}/{name}"
    _assert_identical(two_ranks[0][key], two_ranks[1][key], f"{key}: rank 0 vs rank 1")
    got, want = two_ranks[0][key], _reference(level, name)
    assert got["amp"] == want["amp"]
    for k in ("params", "masters"):
        for x, y in zip(got[k], want[k]):
            assert x.dtype == y.dtype
            torch.testing.assert_close(x.float(), y.float(), **TOLERANCE[level], msg=f"{key}: {k}")


@pytest.mark.slow
@pytest.mark.parametrize("level", LEVELS)
def test_every_rank_skips_the_poisoned_step(two_ranks, level):
    for rank in two_ranks:
        for name in ("inf_hook", "inf_grad"):
            assert rank[f"{level}/{name}"]["amp"]["loss_scaler0"]["unskipped"] == STEPS - 1 - POISON_STEP
        assert rank[f"{level}/train"]["amp"]["loss_scaler0"]["unskipped"] == STEPS


@pytest.mark.slow
def test_initialize_picks_fp32_allreduce_where_there_are_no_masters(two_ranks):
    # O3 keeps half weights without fp32 masters: its half gradients are summed in fp32.
    assert {lv: two_ranks[0][f"{lv}/fp32_allreduce"] for lv in LEVELS} == {lv: lv == "O3" for lv in LEVELS}


@pytest.mark.slow
@pytest.mark.parametrize("level", LEVELS)
def test_checkpoint_resumes_bit_identically(two_ranks, level):
    for rank in two_ranks:  # "train" is the same run, uninterrupted
        _assert_identical(rank[f"{level}/resume"], rank[f"{level}/train"], f"{level}: resumed vs uninterrupted")
