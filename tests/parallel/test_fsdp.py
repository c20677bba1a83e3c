"""ampkit.initialize(..., fsdp=True) on 2 gloo ranks (FSDP2), against single-process runs.

One launch trains every level, injects an inf on one rank, tries the wrong orders and writes
DCP checkpoints; a second launch (new processes) resumes them. The single-process reference
is the same level without FSDP on the concatenated batch (plain BatchNorm there,
SyncBatchNorm in the sharded model). The masterless transient updates (O7, remainder masters)
have a launch and a resume of their own.
"""
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import ampkit
from ampkit.parallel import convert_syncbn_model, full_state_dict, load_sharded, save_sharded

from ._launch import run

pytestmark = pytest.mark.slow

LEVELS = ["O0", "O1", "O2", "O3", "O4", "O5"]
STEPS, POISON_STEP, SAVE_AT = 4, 2, 2
# Per compute dtype: 2 ranks reduce half-batch gradients in fp32 where the single process
# computes one full-batch gradient, so results agree to the rounding of the compute dtype.
TOLERANCE = {"fp32": dict(rtol=1e-5, atol=1e-6), "fp16": dict(rtol=2e-3, atol=2e-3), "bf16": dict(rtol=1e-2, atol=1e-2)}
COMPUTE = {"O0": "fp32", "O1": "fp16", "O2": "fp16", "O3": "fp16", "O4": "bf16", "O5": "bf16"}
CHECKPOINT_LEVELS = ["O0", "O2", "O3", "O5"]
# Accumulation at O0 checks the arithmetic exactly; bf16 is left out there because 2-sample
# micro-batches through BatchNorm amplify bf16 rounding past its tolerance (O4 as much as O5).
ACCUMULATE_CLIP = [("O0", "accumulate"), ("O2", "accumulate"), ("O0", "delay_unscale"), ("O2", "delay_unscale"),
                   ("O2", "clip"), ("O5", "clip")]
HOW = {"accumulate": {"micro": 2}, "delay_unscale": {"micro": 2, "delay": True}, "clip": {"clip": 0.5}}
# The masterless transient updates: bf16 shards, each step computed in fp32 on the local shards.
TRANSIENT = {"O7": {"opt_level": "O7"}, "remainder": {"opt_level": "O5", "master_weights": "remainder"},
             "O7/bf16_state": {"opt_level": "O7", "optimizer_state_dtype": torch.bfloat16}, "O8": {"opt_level": "O8"}}
FIT_STEPS = 6


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)

    def forward(self, x):
        return torch.tanh(self.bn(self.fc(x)))


def make_net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), Block(), Block(), nn.Linear(8, 3))


def global_batches(n=8):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(n, 4, generator=g), torch.randn(n, 3, generator=g)) for _ in range(STEPS)]


def _build(level, seed, distributed, adam=False, fsdp_kwargs=None):
    net = make_net(seed)
    if distributed:
        net = convert_syncbn_model(net)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, eps=1e-3) if adam else torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    # Half-batch losses give each rank twice the single process's per-sample gradient in
    # float16 backward: a scale of 2**16 would overflow there first; cap it.
    return ampkit.initialize(net, opt, **TRANSIENT.get(level, {"opt_level": level}), verbosity=0, max_loss_scale=2.0**10,
                             fsdp=distributed, fsdp_kwargs=(fsdp_kwargs or {"blocks": [Block]}) if distributed else None)


def _micro(t, rank, i):
    """Micro-batch ``i`` of 2: on a rank, half of its shard; in the single process, the
    concatenation of both ranks' micro-batch ``i`` (the same samples meet in SyncBatchNorm)."""
    if rank is not None:
        return t.chunk(2)[rank].chunk(2)[i]
    return torch.cat([t.chunk(2)[r].chunk(2)[i] for r in (0, 1)])


def _train(model, opt, steps, rank=None, poison_at=None, micro=1, clip=None, delay=False):
    """Losses of ``steps`` (global means), and whether the poisoned step left weights and
    optimizer state untouched. ``micro=2`` accumulates two micro-batches per step (plain
    repeated ``scale_loss``; with ``delay``, the first with ``delay_unscale=True`` and, on FSDP,
    without gradient reduction); ``clip`` clips the gradient norm before each step."""
    losses, untouched = [], None
    for step in steps:
        opt.zero_grad()
        for i in range(micro):
            x, y = (_micro(t, rank, i) if micro == 2 else t if rank is None else t.chunk(2)[rank]
                    for t in global_batches()[step])
            first = delay and i == 0
            if rank is not None and delay:
                model.set_requires_gradient_sync(not first)  # FSDP2's no_sync
            loss = F.mse_loss(model(x), y)
            with ampkit.scale_loss(loss, opt, delay_unscale=first) as scaled:
                scaled.backward()
                if step == poison_at and rank in (None, 1):  # one rank only
                    grad = model[0].weight.grad
                    with torch.no_grad():
                        (grad.to_local() if rank is not None else grad).view(-1)[0] = float("inf")
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(list(ampkit.master_params(opt)), clip)
            losses.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        before = _local_state(opt) if step == poison_at else None
        opt.step()
        if before is not None:
            untouched = _same(before, _local_state(opt))
        loss = loss.detach().float()
        if rank is not None:
            dist.all_reduce(loss)
            loss /= 2
        losses.append(loss.item())
    return losses, untouched


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _local_state(opt):
    """This rank's weights, remainders (master_weights="remainder") and optimizer state."""
    params = [_local(p).detach().clone() for p in ampkit.master_params(opt)]
    params += [r.clone() for ms in opt._ampkit.model_states for r in ms.remainders.values()]
    state = [{k: _local(v).clone() if torch.is_tensor(v) else v for k, v in s.items()} for s in opt.state.values()]
    return params, state


def _same(a, b):
    (pa, sa), (pb, sb) = a, b
    return all(torch.equal(x, y) for x, y in zip(pa, pb)) and len(sa) == len(sb) and all(
        sx.keys() == sy.keys() and all(torch.equal(sx[k], sy[k]) if torch.is_tensor(sx[k]) else sx[k] == sy[k] for k in sx)
        for sx, sy in zip(sa, sb))


def _outcome(model, opt, losses, untouched=None):
    full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t.detach().clone()
    return {"losses": losses, "untouched": untouched, "amp": ampkit.state_dict(optimizer=opt),
            "masters": [full(p) for p in ampkit.master_params(opt)],
            "buffers": [b.clone() for b in model.buffers()], "local": _local_state(opt)}


def _unchanged(net, opt):
    """What ``initialize`` would change, to compare before and after a refused call."""
    return (type(net), [id(p) for p in net.parameters()], [_local(p).detach().clone() for p in net.parameters()],
            hasattr(net, "_ampkit"), [id(p) for g in opt.param_groups for p in g["params"]], hasattr(opt, "_ampkit"),
            "step" in vars(opt))


def _same_snapshot(a, b):
    return a[:2] == b[:2] and all(torch.equal(x, y) for x, y in zip(a[2], b[2])) and a[3:] == b[3:]


def _refused(call, net, opt):
    before = _unchanged(net, opt)
    try:
        call()
    except (TypeError, ValueError, RuntimeError) as e:
        return type(e).__name__, str(e), _same_snapshot(before, _unchanged(net, opt))
    return None


def _wrong_orders(rank):
    from torch.distributed.fsdp import fully_shard

    def fresh():
        net = make_net(0)
        return net, torch.optim.SGD(net.parameters(), lr=0.1)

    out = {}
    net, opt = fresh()
    out["ddp_and_fsdp"] = _refused(lambda: ampkit.initialize(net, opt, opt_level="O5", ddp=True, fsdp=True), net, opt)
    out["mp_policy"] = _refused(lambda: ampkit.initialize(net, opt, opt_level="O5", fsdp=True, fsdp_kwargs={"mp_policy": None}), net, opt)
    out["blocks"] = _refused(lambda: ampkit.initialize(net, opt, opt_level="O5", fsdp=True, fsdp_kwargs={"blocks": "Block"}), net, opt)
    out["kwargs_without_fsdp"] = _refused(lambda: ampkit.initialize(net, opt, opt_level="O5", fsdp_kwargs={}), net, opt)
    F.mse_loss(net(torch.randn(4, 4)), torch.zeros(4, 3)).backward()
    opt.step()
    optm = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    optm.state[next(net.parameters())]["momentum_buffer"] = torch.zeros(1)
    out["optimizer_state"] = _refused(lambda: ampkit.initialize(net, optm, opt_level="O5", fsdp=True), net, optm)

    net, opt = fresh()
    fully_shard(net)
    out["sharded_then_fsdp"] = _refused(lambda: ampkit.initialize(net, opt, opt_level="O1", fsdp=True), net, opt)
    out["sharded_then_O5"] = _refused(lambda: ampkit.initialize(net, opt, opt_level="O5"), net, opt)

    # fully_shard after initialize: the model's first call is refused before FSDP2's forward
    # hooks run (whose lazy init would refuse float32 BatchNorm in the half model at O2/O5
    # with an AssertionError), so neither the sharded parameters nor the optimizer change.
    for level in LEVELS:
        net, opt = fresh()
        net, opt = ampkit.initialize(net, opt, opt_level=level, verbosity=0)
        fully_shard(net)
        out[f"fully_shard_after_initialize_{level}"] = _refused(lambda: net(torch.randn(4, 4)), net, opt)
    # ampkit.checkpoint's one-file save/load on a sharded model
    net, opt = fresh()
    model, opt = ampkit.initialize(net, opt, opt_level="O5", verbosity=0, fsdp=True)
    with tempfile.TemporaryDirectory() as tmp:
        out["checkpoint_save"] = _refused(lambda: ampkit.checkpoint.save(f"{tmp}/c.pt", model, opt), model, opt)
        out["checkpoint_load"] = _refused(lambda: ampkit.checkpoint.load(f"{tmp}/c.pt", model, opt), model, opt)
    # fully_shard on what initialize(..., ddp=True) returned: the same
    for level in ("O1", "O5"):
        net, opt = fresh()
        model, opt = ampkit.initialize(net, opt, opt_level=level, verbosity=0, ddp=True)
        fully_shard(model)
        out[f"fully_shard_on_ddp_model_{level}"] = _refused(lambda: model(torch.randn(4, 4)), net, opt)
    return out


def _worker(rank, world_size, checkpoint_dir):
    from torch.distributed.fsdp import fully_shard

    out = {}
    for level in LEVELS:
        model, opt = _build(level, seed=rank, distributed=True)  # ranks start from rank 0's weights
        out[f"{level}/train"] = _outcome(model, opt, *_train(model, opt, range(STEPS), rank))
        model, opt = _build(level, seed=rank, distributed=True)
        out[f"{level}/inf"] = _outcome(model, opt, *_train(model, opt, range(STEPS), rank, poison_at=POISON_STEP))
    for level, how in ACCUMULATE_CLIP:
        model, opt = _build(level, seed=rank, distributed=True)
        out[f"{level}/{how}"] = _outcome(model, opt, *_train(model, opt, range(STEPS), rank, **HOW[how]))
    # fully_shard's own options pass through: the same mesh written out, parameters kept
    # gathered after forward; the arithmetic is unchanged.
    from torch.distributed.device_mesh import init_device_mesh

    kwargs = {"blocks": [Block], "mesh": init_device_mesh("cpu", (2,)), "reshard_after_forward": False}
    model, opt = _build("O5", seed=rank, distributed=True, fsdp_kwargs=kwargs)
    out["O5/options"] = _outcome(model, opt, *_train(model, opt, range(STEPS), rank))
    # The user's own fully_shard, then initialize at a level that casts nothing: that order works.
    net = convert_syncbn_model(make_net(0))
    for block in (net[1], net[2]):
        fully_shard(block)
    fully_shard(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    model, opt = ampkit.initialize(net, opt, opt_level="O1", verbosity=0, max_loss_scale=2.0**10)
    out["O1/sharded_first"] = _outcome(model, opt, *_train(model, opt, range(STEPS), rank))
    out["errors"] = _wrong_orders(rank)
    for level in CHECKPOINT_LEVELS:
        model = _uninterrupted_and_saved(level, rank, checkpoint_dir, out)
        if level == "O5":
            out["export"] = full_state_dict(model)
    return out


def _uninterrupted_and_saved(level, rank, checkpoint_dir, out):
    """``out[level + "/uninterrupted"]``: the outcome of STEPS steps (with an inf at step 1); and a
    second run's sharded checkpoint after SAVE_AT steps. Returns the uninterrupted model."""
    model, opt = _build(level, seed=rank, distributed=True, adam=True)
    out[f"{level}/uninterrupted"] = _outcome(model, opt, *_train(model, opt, range(STEPS), rank, poison_at=1))
    saved, saved_opt = _build(level, seed=rank, distributed=True, adam=True)
    _train(saved, saved_opt, range(SAVE_AT), rank, poison_at=1)
    save_sharded(f"{checkpoint_dir}/{level}", saved, saved_opt)
    return model


def _resume_worker(rank, world_size, checkpoint_dir, levels):
    """Each level's checkpoint loaded into a model built from other weights, trained to STEPS."""
    out = {}
    for level in levels:
        model, opt = _build(level, seed=100 + rank, distributed=True, adam=True)
        load_sharded(f"{checkpoint_dir}/{level}", model, opt)
        out[level] = _outcome(model, opt, *_train(model, opt, range(SAVE_AT, STEPS), rank))
    return out


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("dcp"))


@pytest.fixture(scope="module")
def two_ranks(checkpoint_dir):
    return run(_worker, 2, checkpoint_dir, timeout=900, pg_timeout=600)


@pytest.fixture(scope="module")
def resumed(two_ranks, checkpoint_dir):
    return run(_resume_worker, 2, checkpoint_dir, CHECKPOINT_LEVELS, timeout=900, pg_timeout=600)


def _reference(level, **kwargs):
    model, opt = _build(level, seed=0, distributed=False)
    return _outcome(model, opt, *_train(model, opt, range(STEPS), **kwargs))


def _assert_ranks_agree(ranks, key):
    a, b = ranks[0][key], ranks[1][key]
    assert a["losses"] == b["losses"] and a["amp"] == b["amp"], key
    for x, y in zip(a["masters"] + a["buffers"], b["masters"] + b["buffers"]):
        assert torch.equal(x, y), key


def _assert_matches(got, want, level):
    tol = TOLERANCE[COMPUTE[level]]
    assert got["amp"] == want["amp"]
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]), **tol)
    for x, y in zip(got["masters"], want["masters"]):
        assert x.dtype == y.dtype
        torch.testing.assert_close(x.float(), y.float(), **tol)


@pytest.mark.parametrize("level", LEVELS)
def test_loss_curve_matches_single_process(two_ranks, level):
    _assert_ranks_agree(two_ranks, f"{level}/train")
    got = two_ranks[0][f"{level}/train"]
    # The optimizer steps on fp32 shards (FSDP's masters) except at O3 (half shards).
    assert {x.dtype for x in got["masters"]} == {torch.float16 if level == "O3" else torch.float32}
    _assert_matches(got, _reference(level), level)


@pytest.mark.parametrize("level", LEVELS)
def test_inf_on_one_rank_skips_the_step_on_every_rank(two_ranks, level):
    _assert_ranks_agree(two_ranks, f"{level}/inf")
    for rank in two_ranks:
        got = rank[f"{level}/inf"]
        assert got["untouched"] is True  # weights and optimizer state, on every rank
        assert got["amp"]["loss_scaler0"]["unskipped"] == STEPS - 1 - POISON_STEP
        # dynamic (O1/O2) backs off from the cap 2**10; static scales stay
        assert got["amp"]["loss_scaler0"]["loss_scale"] == {"O1": 512.0, "O2": 512.0}.get(level, 1.0)
    _assert_matches(two_ranks[0][f"{level}/inf"], _reference(level, poison_at=POISON_STEP), level)


@pytest.mark.parametrize("level, how", ACCUMULATE_CLIP)
def test_accumulation_and_clipping_match_single_process(two_ranks, level, how):
    """Two scale_loss calls per step (plain, or the first with delay_unscale=True and FSDP's
    gradient sync off); clip_grad_norm_ on master_params (the sharded gradients: its "losses"
    here are the total norms)."""
    _assert_ranks_agree(two_ranks, f"{level}/{how}")
    want = _reference(level, **HOW[how])
    _assert_matches(two_ranks[0][f"{level}/{how}"], want, level)


def test_fully_shard_options_pass_through(two_ranks):
    for rank in two_ranks:
        got, want = rank["O5/options"], rank["O5/train"]
        assert got["losses"] == want["losses"]
        assert all(torch.equal(x, y) for x, y in zip(got["masters"], want["masters"]))


def test_initialize_after_users_fully_shard_works_where_nothing_is_cast(two_ranks):
    _assert_ranks_agree(two_ranks, "O1/sharded_first")
    _assert_matches(two_ranks[0]["O1/sharded_first"], _reference("O1"), "O1")


EXPECTED_ERRORS = {
    "ddp_and_fsdp": ("ValueError", "initialize(ddp=True, fsdp=True): choose one"),
    "mp_policy": ("ValueError", "unknown key(s) ['mp_policy'] (the opt level sets the MixedPrecisionPolicy)"),
    "blocks": ("TypeError", "expected a list of nn.Module subclasses"),
    "kwargs_without_fsdp": ("ValueError", "initialize(fsdp_kwargs=...): only used with fsdp=True"),
    "optimizer_state": ("ValueError", "SGD already has state for 1 parameter(s)"),
    "sharded_then_fsdp": ("RuntimeError", "initialize(fsdp=True): the model was already sharded with fully_shard"),
    "sharded_then_O5": ("RuntimeError", "at O5 the model is cast to half, which FSDP2 would undo"),
    **{f"fully_shard_after_initialize_{level}": ("RuntimeError", "fully_shard was applied after ampkit.initialize")
       for level in LEVELS},
    **{f"fully_shard_on_ddp_model_{level}": ("RuntimeError", "fully_shard was applied after ampkit.initialize")
       for level in ("O1", "O5")},
    "checkpoint_save": ("ValueError", "Use ampkit.parallel.save_sharded("),
    "checkpoint_load": ("ValueError", "Use ampkit.parallel.load_sharded("),
}


@pytest.mark.parametrize("case", sorted(EXPECTED_ERRORS))
def test_wrong_orders_are_clear_errors_that_change_nothing(two_ranks, case):
    for rank in two_ranks:
        got = rank["errors"][case]
        assert got is not None, f"{case}: no error"
        kind, message, unchanged = got
        assert kind == EXPECTED_ERRORS[case][0] and EXPECTED_ERRORS[case][1] in message, message
        assert unchanged, f"{case}: something was modified"


@pytest.mark.parametrize("level", CHECKPOINT_LEVELS)
def test_dcp_checkpoint_resumes_bit_exactly_in_new_processes(two_ranks, resumed, level):
    for rank, (before, after) in enumerate(zip(two_ranks, resumed)):
        want, got = before[f"{level}/uninterrupted"], after[level]
        assert got["losses"] == want["losses"][SAVE_AT:]
        assert got["amp"] == want["amp"]
        assert want["amp"]["loss_scaler0"]["loss_scale"] == (512.0 if level == "O2" else 1.0)  # the scaler state matters
        for x, y in zip(got["masters"] + got["buffers"], want["masters"] + want["buffers"]):
            assert torch.equal(x, y), f"rank {rank}"
        assert _same(got["local"], want["local"]), f"rank {rank}: optimizer state"


def test_full_state_dict_exports_float32_on_rank_0_for_a_plain_model(two_ranks):
    assert two_ranks[1]["export"] == {}  # rank 0 alone holds the whole model, on CPU
    for rank in two_ranks[:1]:
        export = rank["export"]
        plain = make_net(0)
        assert list(export) == list(plain.state_dict())
        assert all(v.dtype == torch.float32 for k, v in export.items() if "num_batches" not in k)
        plain.load_state_dict(export)
        for p, m in zip(plain.parameters(), rank["O5/uninterrupted"]["masters"]):
            assert torch.equal(p, m)


@pytest.mark.parametrize("level", ["O7", "remainder"])
def test_transient_update_with_fsdp_shards_bf16_parameters_and_says_so(level, caplog):
    import logging

    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        with caplog.at_level(logging.INFO, logger="ampkit"):
            model, opt = ampkit.initialize(model, opt, **TRANSIENT[level], fsdp=True, verbosity=1)
        assert all(isinstance(p, DTensor) and p.dtype == torch.bfloat16 for p in model.parameters())
        assert [p for g in opt.param_groups for p in g["params"]] == list(model.parameters())
        assert ampkit.footprint.persistent_bytes([model], [opt])["masters"] == (0 if level == "O7" else 2 * (64 + 8 + 16 + 2))
        how = "rounded back stochastic" if level == "O7" else "masters held as bf16 shards plus int16 remainder shards"
        assert any("fsdp=True: torch.bfloat16 parameters sharded (no fp32 master shards)" in r.getMessage()
                   and how in r.getMessage() for r in caplog.records)
    finally:
        dist.destroy_process_group()


# -- the masterless transient updates (O7, master_weights="remainder") ----------------------

def _transient_worker(rank, world_size, checkpoint_dir):
    """Each transient mode (and O5, to compare) trained, poisoned, fitted to one batch, and
    checkpointed at SAVE_AT."""
    out = {}
    model, opt = _build("O5", seed=rank, distributed=True)
    out["O5/train"] = _outcome(model, opt, *_train(model, opt, range(STEPS), rank))
    opt.zero_grad()
    out["O5/footprint"] = ampkit.footprint.persistent_bytes([model], [opt])
    for level in TRANSIENT:
        model, opt = _build(level, seed=rank, distributed=True)
        out[f"{level}/export"] = {k: v.clone() for k, v in full_state_dict(model).items()}  # the masters before training
        out[f"{level}/train"] = _outcome(model, opt, *_train(model, opt, range(STEPS), rank))
        rounding = opt._ampkit.run.rounder
        out[f"{level}/rounding"] = None if rounding is None else rounding.state_dict()
        opt.zero_grad()
        out[f"{level}/footprint"] = ampkit.footprint.persistent_bytes([model], [opt])
        out[f"{level}/bf16_numels"] = [_local(p).numel() for p in model.parameters() if p.dtype == torch.bfloat16]
        model, opt = _build(level, seed=rank, distributed=True)
        out[f"{level}/inf"] = _outcome(model, opt, *_train(model, opt, range(STEPS), rank, poison_at=POISON_STEP))
        model, opt = _build(level, seed=rank, distributed=True, adam=True)
        out[f"{level}/fit"] = _train(model, opt, [0] * FIT_STEPS, rank)[0]  # one batch, again and again
        _uninterrupted_and_saved(level, rank, checkpoint_dir, out)
    return out


@pytest.fixture(scope="module")
def transient_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("dcp_transient"))


@pytest.fixture(scope="module")
def transient_ranks(transient_dir):
    return run(_transient_worker, 2, transient_dir, timeout=900, pg_timeout=600)


@pytest.fixture(scope="module")
def transient_resumed(transient_ranks, transient_dir):
    return run(_resume_worker, 2, transient_dir, list(TRANSIENT), timeout=900, pg_timeout=600)


def _scalers(amp):
    return {k: v for k, v in amp.items() if k.startswith("loss_scaler")}


def _assert_transient_ranks_agree(ranks, key):
    """Losses, scalers, whole weights and buffers equal on both ranks."""
    a, b = ranks[0][key], ranks[1][key]
    assert a["losses"] == b["losses"] and _scalers(a["amp"]) == _scalers(b["amp"]), key
    for x, y in zip(a["masters"] + a["buffers"], b["masters"] + b["buffers"]):
        assert torch.equal(x, y), key


def _assert_close(got, want):
    tol = TOLERANCE["bf16"]
    assert _scalers(got["amp"]) == _scalers(want["amp"])
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]), **tol)
    for x, y in zip(got["masters"], want["masters"]):
        torch.testing.assert_close(x.float(), y.float(), **tol)


@pytest.mark.parametrize("level", TRANSIENT)
def test_transient_update_on_bf16_shards_matches_single_process(transient_ranks, level):
    """Within bf16 rounding, not bit for bit: FSDP2 sums the ranks' bf16 gradients in float32
    and stores the sum as bf16 (the parameter's dtype), where the single process computes one
    bf16 gradient of the whole batch; at O7 each rank also draws its own rounding bits."""
    _assert_transient_ranks_agree(transient_ranks, f"{level}/train")
    got = transient_ranks[0][f"{level}/train"]
    # the optimizer steps on the model's own bf16 shards (BatchNorm kept float32)
    bf16, fp32 = torch.bfloat16, torch.float32
    assert [x.dtype for x in got["masters"]] == [bf16] * 2 + [bf16, bf16, fp32, fp32] * 2 + [bf16] * 2
    _assert_close(got, _reference(level))


def test_remainder_on_fsdp_follows_o5_on_fsdp(transient_ranks):
    """The same arithmetic as O5 on FSDP2 but for the bf16 rounding of the reduced gradient
    (O5's fp32 shards keep the float32 sum, FSDP2 stores a bf16 parameter's gradient in bf16):
    the same first loss (the same bf16 weights), then within bf16 rounding."""
    got, want = transient_ranks[0]["remainder/train"], transient_ranks[0]["O5/train"]
    assert got["losses"][0] == want["losses"][0]
    _assert_close(got, want)


def test_remainder_masters_start_from_the_first_ranks_fp32_values(transient_ranks):
    """Each rank's remainder shards are cut from rank 0's fp32 weights (not from the bf16 copy
    broadcast to every rank): the exported masters are rank 0's model bit for bit."""
    assert transient_ranks[1]["remainder/export"] == {}
    export, plain = transient_ranks[0]["remainder/export"], make_net(0).state_dict()
    assert list(export) == list(plain)
    for key, value in plain.items():
        assert export[key].dtype == value.dtype and torch.equal(export[key], value), key
    o7 = transient_ranks[0]["O7/export"]  # O7 has no masters: its bf16 weights, widened
    assert any(not torch.equal(o7[k], v) for k, v in plain.items())
    assert all(torch.equal(o7[k], v.bfloat16().float()) for k, v in plain.items() if k.endswith("0.weight"))


@pytest.mark.parametrize("level", TRANSIENT)
def test_transient_update_keeps_no_fp32_master_shards(transient_ranks, level):
    """Per rank: the masters cost nothing at O7 and 2 bytes per bf16 element at remainder (its
    int16 remainders); weights plus masters take no more than O5's fp32 shards (equal on rank 0,
    whose shards have no padding)."""
    for rank, got in enumerate(transient_ranks):
        fp, o5, numels = got[f"{level}/footprint"], got["O5/footprint"], got[f"{level}/bf16_numels"]
        masters = 2 * sum(numels) if level == "remainder" else 0
        assert fp["masters"] == masters and o5["masters"] == 0
        assert fp["weights"] + fp["masters"] <= o5["weights"]
        if rank == 0:
            assert fp["weights"] + 2 * sum(numels) == o5["weights"]
        # SGD's momentum of each bf16 shard: fp32 as O5's; bf16: 2 bytes less per element;
        # O8: 1-byte codes and a float32 scale per block of 256 of the shard
        less = {"O7/bf16_state": 2 * sum(numels), "O8": sum(3 * n - 4 * -(-n // 256) for n in numels)}.get(level, 0)
        assert fp["optimizer_state"] == o5["optimizer_state"] - less


@pytest.mark.parametrize("level", TRANSIENT)
def test_every_shard_holds_the_same_rounding_state(transient_ranks, level):
    """The rounding state is the seed (0) and the step count, the same on every rank: the bits
    depend on each element's index in its full parameter, so shards differ without a stream of their own."""
    states = [rank[f"{level}/rounding"] for rank in transient_ranks]
    assert states == ([None, None] if level == "remainder" else [{"seed": 0, "step": STEPS}] * 2)


@pytest.mark.parametrize("level", TRANSIENT)
def test_transient_update_fits_one_batch(transient_ranks, level):
    for rank in transient_ranks:
        losses = rank[f"{level}/fit"]
        assert losses == transient_ranks[0][f"{level}/fit"]
        assert all(b < a for a, b in zip(losses, losses[1:])), losses


@pytest.mark.parametrize("level", TRANSIENT)
def test_transient_update_inf_on_one_rank_skips_on_every_rank(transient_ranks, level):
    _assert_transient_ranks_agree(transient_ranks, f"{level}/inf")
    for rank in transient_ranks:
        got = rank[f"{level}/inf"]
        assert got["untouched"] is True  # weights, remainders, optimizer state
        assert got["amp"]["loss_scaler0"] == {"loss_scale": 1.0, "unskipped": STEPS - 1 - POISON_STEP}
    _assert_close(transient_ranks[0][f"{level}/inf"], _reference(level, poison_at=POISON_STEP))


@pytest.mark.parametrize("level", TRANSIENT)
def test_transient_update_dcp_checkpoint_resumes_bit_exactly_in_new_processes(transient_ranks, transient_resumed, level):
    for rank, (before, after) in enumerate(zip(transient_ranks, transient_resumed)):
        want, got = before[f"{level}/uninterrupted"], after[level]
        assert got["losses"] == want["losses"][SAVE_AT:]
        assert _scalers(got["amp"]) == _scalers(want["amp"]) and want["amp"]["loss_scaler0"]["unskipped"] == 2
        for x, y in zip(got["masters"] + got["buffers"], want["masters"] + want["buffers"]):
            assert torch.equal(x, y), f"rank {rank}"
        # weights, remainders, this rank's optimizer state; the rounder's seed and step
        assert got["amp"].get("stochastic_rounding") == want["amp"].get("stochastic_rounding"), f"rank {rank}"
        assert _same(got["local"], want["local"]), f"rank {rank}"
    if level == "remainder":
        assert all(r[f"{level}/uninterrupted"]["local"][0][-1].dtype == torch.int16 for r in transient_ranks)
    else:  # O7 and O8 round with counter bits: the same seed and step counter on every rank
        a, b = (r[f"{level}/uninterrupted"]["amp"]["stochastic_rounding"] for r in transient_ranks)
        assert a == b and a.keys() == {"seed", "step"} and a["step"] > 0


# The test writes genuine DCP metadata with dcp.save in this one process, without a process
# group; torch says it assumes a single-process save, which is what is meant.
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled, unavailable or uninitialized:UserWarning")
def test_load_sharded_refuses_metadata_that_dcp_did_not_write(tmp_path):
    import pickle

    from ampkit._parallel.fsdp import check_metadata

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = ampkit.initialize(model, opt, opt_level="O5", verbosity=0)
    (tmp_path / ".metadata").write_bytes(pickle.dumps(print))  # a global DCP never writes (os.system would run)
    with pytest.raises(ValueError, match=r"\.metadata is not the metadata that torch.distributed.checkpoint writes"):
        load_sharded(tmp_path, model, opt)
    good = tmp_path / "good"
    import torch.distributed.checkpoint as dcp

    dcp.save({"a": torch.ones(3, dtype=torch.bfloat16), "amp": {"loss_scaler0": {"loss_scale": 1.0}}}, checkpoint_id=good)
    check_metadata(good)  # what DCP writes passes
