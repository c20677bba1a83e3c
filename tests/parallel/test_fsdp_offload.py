"""``fsdp_kwargs={"offload_policy": CPUOffloadPolicy(pin_memory=False)}`` at O5, O7 (float32
and bf16 state), O8 and remainder masters, on 2 gloo ranks in one launch.

Per level: the offloaded run equals the same run without offload bit for bit (weights,
optimizer state, loss scalers, an overflow on one rank skipped alike); every local shard
the step reads or writes (weights, gradients, state, remainders) is a CPU tensor; O7's
fused AdamW steps every offloaded shard; a ``save_sharded`` checkpoint of the offloaded
run, loaded into a fresh model with offload or without, resumes it bit for bit.

The mesh is the CPU's (on any machine), so offload moves nothing: this shows that FSDP2's
offload code paths (gradients ``.to("cpu")``, no pinning, its lazy-init checks) change
nothing in ampkit's step and checkpoints, not that no device copies happen with a CUDA mesh
(nor the found-inf flag's trip to the GPU under NCCL alone), which needs a GPU.
"""
import pytest
import torch
import torch.nn.functional as F

import ampkit
from ampkit._update import fused_update
from ampkit.parallel import full_state_dict, load_sharded, save_sharded
from ampkit._parallel.fsdp import is_sharded

from ._launch import run
from ._tiny import Block, assert_state_equal, batch, snapshot

pytestmark = pytest.mark.slow

CASES = {"O5": {"opt_level": "O5"}, "O7": {"opt_level": "O7"},
         "O7/bf16_state": {"opt_level": "O7", "optimizer_state_dtype": torch.bfloat16}, "O8": {"opt_level": "O8"},
         "remainder": {"opt_level": "O5", "master_weights": "remainder"}}
STEPS, SAVE_AT, POISON = 5, 3, 1


def _build(case: str, seed: int, offload: bool):
    """``_tiny``'s MLP and AdamW at ``case``, on a CPU mesh (FSDP2's default would be a CUDA one
    where there is one), with ``CPUOffloadPolicy(pin_memory=False)`` when ``offload``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy

    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), Block(), Block(), torch.nn.Linear(8, 3))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, eps=1e-3)
    kw = {"blocks": [Block], "mesh": init_device_mesh("cpu", (2,))}
    if offload:
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    return ampkit.initialize(net, opt, **CASES[case], verbosity=0, max_loss_scale=2.0**10, fsdp=True, fsdp_kwargs=kw)


def _train(model, opt, steps, rank, world_size):
    """Steps ``steps``; at :data:`POISON` rank 1's gradient holds an inf (every rank skips)."""
    skipped = []
    for step in steps:
        opt.zero_grad()
        x, y = batch(step, rank, world_size)
        with ampkit.scale_loss(F.mse_loss(model(x).float(), y), opt) as scaled:
            scaled.backward()
            if step == POISON and rank == 1:
                with torch.no_grad():
                    next(model.parameters()).grad.to_local().view(-1)[0] = float("inf")
        opt.step()
        skipped.append(ampkit.step_was_skipped(opt))
    return skipped


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _devices(model, opt) -> set:
    """The device types of every local shard the step reads or writes: weights, gradients,
    optimizer state, remainders."""
    tensors = [p for p in model.parameters()] + [p.grad for p in model.parameters()]
    tensors += [v for state in opt.state.values() for v in state.values() if torch.is_tensor(v)]
    tensors += list(getattr(model._ampkit, "remainders", {}).values())
    return {_local(t).device.type for t in tensors}


def _offloads(model) -> list:
    """FSDP2's own record, per sharded parameter: whether it offloads to the CPU."""
    from torch.distributed.fsdp import FSDPModule

    return [fp.offload_to_cpu for m in model.modules() if isinstance(m, FSDPModule)
            for fp in m._get_fsdp_state()._fsdp_param_group.fsdp_params]


def _refused(policy):
    """``initialize`` with ``offload_policy=policy``: the error, and whether the model and
    optimizer were left as they were."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), Block(), torch.nn.Linear(8, 3))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    params, values = list(net.parameters()), [p.detach().clone() for p in net.parameters()]
    try:
        ampkit.initialize(net, opt, opt_level="O5", fsdp=True, fsdp_kwargs={"offload_policy": policy}, verbosity=0)
    except (TypeError, ValueError) as e:
        untouched = (not is_sharded(net) and getattr(net, "_ampkit", None) is None and list(net.parameters()) == params
                     and opt.param_groups[0]["params"] == params and not opt.state
                     and all(torch.equal(p, v) for p, v in zip(net.parameters(), values)))
        return type(e).__name__, str(e), untouched
    return None


def _offloaded_shard(local: torch.Tensor, mesh, shape) -> torch.Tensor:
    """A CPU shard of a parameter of ``shape`` on ``mesh``, wrapped as FSDP2 wraps an offloaded one."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    stride = torch.empty(shape).stride()
    spec = DTensorSpec(mesh, (Shard(0),), tensor_meta=TensorMeta(torch.Size(shape), stride, local.dtype))
    return DTensor(local, spec, requires_grad=False)


def _steps_on_meshes(rank):
    """CPU shards on a mesh whose device type is "cuda" (what ``CPUOffloadPolicy`` gives on a
    GPU; the mesh runs nothing) and on a CPU mesh: O7's fused AdamW and a torch AdamW on the
    float32 copies the transient update wraps with ``shards.like`` (O8, remainder). Per mesh:
    the weights, the state, and the device types of the state's local parts and mesh."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    from ampkit._kernels.rounding import StochasticRounder
    from ampkit._update.shards import like

    meshes = {"cuda": DeviceMesh("cuda", torch.arange(2), _init_backend=False), "cpu": init_device_mesh("cpu", (2,))}
    out = {}
    for kind, mesh in meshes.items():
        g = torch.Generator().manual_seed(rank)
        rows = 5 - rank  # a (9, 5) parameter: 5 rows on rank 0, 4 on rank 1
        p = torch.nn.Parameter(_offloaded_shard(torch.randn(rows, 5, generator=g).bfloat16(), mesh, (9, 5)))
        copy = torch.nn.Parameter(like(p.to_local().float(), p))  # a transient fp32 copy
        opt, copy_opt = (torch.optim.AdamW([t], lr=1e-2, weight_decay=0.1) for t in (p, copy))
        rounder = StochasticRounder(0)
        for _ in range(3):
            grad = torch.randn(rows, 5, generator=g)
            fused_update.step(opt, [(opt.param_groups[0], p)], {p: _offloaded_shard(grad.bfloat16(), mesh, (9, 5))},
                              None, rounder, {p: 0})
            rounder.advance()
            copy.grad = like(grad, copy)
            copy_opt.step()
        states = [v for o in (opt, copy_opt) for st in o.state.values() for v in st.values() if hasattr(v, "to_local")]
        out[kind] = {"weights": [p.to_local().clone(), copy.to_local().clone()],
                     "state": [v.to_local().clone() for v in states],
                     "devices": {(v.to_local().device.type, v.device_mesh.device_type) for v in states + [copy]}}
    return out


def _worker(rank, world_size, tmp):
    from torch.distributed.fsdp import CPUOffloadPolicy

    fused = []
    step = fused_update.step

    def counting(optimizer, params, *args):  # the offloaded shards O7's fused AdamW steps
        fused.extend(p for _, p in params)
        return step(optimizer, params, *args)

    fused_update.step = counting
    out = {"refused": {"not_a_policy": _refused("cpu")}, "meshes": _steps_on_meshes(rank)}
    if not torch.accelerator.is_available():
        out["refused"]["pinned_without_accelerator"] = _refused(CPUOffloadPolicy())
    for case in CASES:
        model, opt = _build(case, rank, offload=False)
        start = {k: v.clone() for k, v in full_state_dict(model).items()}
        plain = {"start": start, "skipped": _train(model, opt, range(STEPS), rank, world_size),
                 "state": snapshot(model, opt)}
        fused.clear()
        model, opt = _build(case, rank, offload=True)
        skipped = _train(model, opt, range(SAVE_AT), rank, world_size)
        save_sharded(f"{tmp}/{case.replace('/', '_')}", model, opt)
        skipped += _train(model, opt, range(SAVE_AT, STEPS), rank, world_size)
        offloaded = {"skipped": skipped, "state": snapshot(model, opt), "devices": _devices(model, opt),
                     "fused": len(fused), "fused_params": len({id(p) for p in fused}),
                     "params": len(list(model.parameters())), "offloads": _offloads(model)}
        model, opt = _build(case, 100 + rank, offload=True)
        load_sharded(f"{tmp}/{case.replace('/', '_')}", model, opt)
        resumed = {"skipped": _train(model, opt, range(SAVE_AT, STEPS), rank, world_size),
                   "state": snapshot(model, opt), "devices": _devices(model, opt)}
        model, opt = _build(case, 100 + rank, offload=False)  # the same checkpoint, offload turned off
        load_sharded(f"{tmp}/{case.replace('/', '_')}", model, opt)
        _train(model, opt, range(SAVE_AT, STEPS), rank, world_size)
        out[case] = {"plain": plain, "offloaded": offloaded, "resumed": resumed,
                     "resumed_without": {"state": snapshot(model, opt)}}
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run(_worker, 2, str(tmp_path_factory.mktemp("offload")), timeout=900, pg_timeout=600)


@pytest.mark.parametrize("case", CASES)
def test_offload_equals_no_offload_and_resumes_bit_for_bit(two_ranks, case):
    for rank in two_ranks:
        got = rank[case]
        assert got["plain"]["skipped"] == got["offloaded"]["skipped"] == [s == POISON for s in range(STEPS)]
        assert got["resumed"]["skipped"] == [False] * (STEPS - SAVE_AT)
        assert got["offloaded"]["devices"] == got["resumed"]["devices"] == {"cpu"}
    plain, offloaded, resumed = (two_ranks[0][case][k]["state"] for k in ("plain", "offloaded", "resumed"))
    assert_state_equal(offloaded, plain, "exact", f"{case}: offload vs none")  # same shards: O8 exact too
    assert_state_equal(resumed, offloaded, "exact", f"{case}: resumed vs continuous")
    without = two_ranks[0][case]["resumed_without"]["state"]
    assert_state_equal(without, offloaded, "exact", f"{case}: resumed without offload vs continuous")
    start = two_ranks[0][case]["plain"]["start"]
    assert start.keys() == plain["model"].keys()
    assert all(not torch.equal(plain["model"][k], v) for k, v in start.items())  # every tensor trained


@pytest.mark.parametrize("case", CASES)
def test_offload_reaches_fsdp2_and_o7_fuses_the_offloaded_shards(two_ranks, case):
    for rank in two_ranks:
        got = rank[case]["offloaded"]
        assert got["offloads"] and all(got["offloads"]) and len(got["offloads"]) == got["params"]
        if case.startswith("O7"):  # every shard through the fused AdamW, every step that was not skipped
            assert got["fused_params"] == got["params"] and got["fused"] == got["params"] * (STEPS - 1)
        else:
            assert got["fused"] == 0


def test_bad_offload_policies_are_refused_before_anything_changes(two_ranks):
    expected = {"not_a_policy": ("TypeError", "initialize(fsdp_kwargs={'offload_policy': 'cpu'}): expected a "
                                              "torch.distributed.fsdp.CPUOffloadPolicy"),
                "pinned_without_accelerator": ("ValueError", "pass CPUOffloadPolicy(pin_memory=False)")}
    for rank in two_ranks:
        assert rank["refused"].keys() <= expected.keys() and "not_a_policy" in rank["refused"]
        for name, got in rank["refused"].items():
            assert got is not None, name
            kind, message, untouched = got
            assert kind == expected[name][0] and expected[name][1] in message and untouched, (name, got)


def test_state_of_cpu_shards_of_an_accelerators_mesh_stays_on_the_cpu(two_ranks):
    for rank in two_ranks:
        cuda, cpu = rank["meshes"]["cuda"], rank["meshes"]["cpu"]
        assert cuda["devices"] == {("cpu", "cuda")} and cpu["devices"] == {("cpu", "cpu")}
        assert len(cuda["state"]) == len(cpu["state"]) == 4  # exp_avg and exp_avg_sq of each optimizer
        for got, want in zip(cuda["weights"] + cuda["state"], cpu["weights"] + cpu["state"]):
            assert got.dtype == want.dtype and torch.equal(got, want)
