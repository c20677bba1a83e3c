"""Opt levels on FSDP2 (``torch.distributed.fsdp.fully_shard``): ``initialize(..., fsdp=True)``.

Each level maps onto FSDP2's own machinery; nothing here communicates by itself:

* O2 / O5 (half model with fp32 masters): ``MixedPrecisionPolicy(param_dtype=half,
  reduce_dtype=float32)``. The sharded fp32 parameters are the master weights (no second
  copy): the optimizer steps on them, FSDP all-gathers them in half for compute and
  reduce-scatters gradients in float32. BatchNorm (``keep_batchnorm_fp32``) and the Mixed*
  norms get a ``fully_shard`` group of their own that stays float32 and takes half input.
* O3 (half model, no masters): the model is cast to half and its half parameters are
  sharded; gradients are reduce-scattered in float32 (as ``ddp=True`` all-reduces in fp32).
* O7 and ``master_weights="remainder"`` (bf16 model, masterless transient update): as O3,
  ``MixedPrecisionPolicy(reduce_dtype=float32)`` on bf16 shards, so there is no fp32 copy of
  the weights, all-gathers move bf16 and gradients are summed in float32 (FSDP2 stores the
  reduced gradient in the parameter's dtype, bf16). The chunked update (``_update/chunks.py``) steps each rank's
  local shards (``_update/shards.py``); remainders are local int16 shards; the rounding bits
  are a pure function of the seed, the step and each element's index in its full parameter
  (``_kernels/counter_bits.py``), so every rank rounds its shard as one unsharded run would.
* O1 / O4: fp32 sharded parameters, ``torch.autocast`` inside the model's forward.
* O0: plain FSDP2.

Loss scaling is ampkit's: each rank checks its gradient shards and the found-inf flag is
MAX-reduced over all ranks (one all-reduce), so every rank skips the same steps. A 2-D mesh
(``fsdp_kwargs={"mesh": ...}``, replicate x shard) gives HSDP; replicas round alike.
Checkpoints load on any number of ranks, mesh and level (``reshard.py``).
"""
import dataclasses
import os
import pickle
import sys
import warnings
import weakref
from typing import Dict, Optional

import torch
import torch.distributed as dist
from torch import nn

from .._common.errors import NoEffectWarning
from .._config.levels import HALF_DTYPES, UpdateKind
from .._model.casting import is_batchnorm
from .._run import registry
from .._run.overflow import collective_device
from .._run.run import ROUNDING_KEY
from .._update.shards import is_dtensor
from . import reshard
from .clean_exit import guard_exit

__all__ = ["FSDP_KWARGS", "full_state_dict", "is_sharded", "load_sharded", "save_sharded"]

FSDP_KWARGS = ("blocks", "mesh", "reshard_after_forward", "offload_policy")


def is_sharded(model: nn.Module) -> bool:
    """True when ``fully_shard`` was applied to ``model`` or to one of its submodules."""
    fsdp = sys.modules.get("torch.distributed.fsdp")  # not imported: nothing can be sharded
    return fsdp is not None and any(isinstance(m, fsdp.FSDPModule) for m in model.modules())


def gradient_sync_off(model: nn.Module) -> bool:
    """Whether some FSDP2 module of ``model`` holds its gradients back (``set_requires_gradient_sync(False)``)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and any(
        not group.reduce_grads for m in model.modules() if isinstance(m, fsdp.FSDPModule)
        for group in m._get_fsdp_state()._fsdp_param_groups)


def _keeps_float32(module: nn.Module, keep_bn: bool) -> bool:
    """Modules whose parameters stay float32 in a half model (as ``cast_module_`` decides)."""
    return (keep_bn and is_batchnorm(module)) or bool(getattr(module, "keeps_float32_params", False))


class Plan:
    """A checked ``initialize(..., fsdp=True)``: how each model is sharded at its opt level."""

    def __init__(self, props, kwargs: dict, output_dtype: Optional[torch.dtype]):
        from torch.distributed.fsdp import MixedPrecisionPolicy

        half = props.cast_model_type if props.cast_model_type in HALF_DTYPES else None
        self.half_model = half is not None
        self.masters = props.update is UpdateKind.MASTERS
        self.keep_bn = half is not None and bool(props.keep_batchnorm_fp32)
        self.blocks = tuple(kwargs.get("blocks", ()))
        self.shard_kwargs = {k: v for k, v in kwargs.items() if k != "blocks"}
        # The model as ``_prepare_model`` should see it: with FSDP's masters nothing is cast
        # (FSDP casts its all-gathered copy, and the inputs and outputs).
        self.model_props = props
        if self.masters:
            self.model_props = dataclasses.replace(props, cast_model_type=None, keep_batchnorm_fp32=None)
        self.block_policy = MixedPrecisionPolicy(
            param_dtype=half if self.masters else None,
            reduce_dtype=torch.float32 if half is not None else None,
        )
        # Only the model's output is cast back (ModelState does it where nothing is cast).
        self.root_policy = dataclasses.replace(
            self.block_policy, output_dtype=(output_dtype or torch.float32) if self.masters else None)
        # float32 islands inside a half model: no input cast (they take half input).
        self.float32_policy = MixedPrecisionPolicy(reduce_dtype=torch.float32, cast_forward_inputs=False)
        if half is None:
            self.notes = [f"fsdp=True: fp32 sharded parameters{', autocast in forward' if props.patch_torch_functions else ''}."]
        elif self.masters:
            self.notes = [f"fsdp=True: MixedPrecisionPolicy(param_dtype={half}, reduce_dtype=torch.float32); the sharded "
                          f"fp32 parameters are the master weights."]
        elif props.update in (UpdateKind.ROUNDED, UpdateKind.EIGHT_BIT, UpdateKind.REMAINDER):
            how = ("masters held as bf16 shards plus int16 remainder shards" if props.update is UpdateKind.REMAINDER
                   else f"rounded back {props.update_rounding}")
            self.notes = [f"fsdp=True: {half} parameters sharded (no fp32 master shards), gradients reduced in "
                          f"float32; each step computed in fp32 on the local shards, {how}."]
        else:
            self.notes = [f"fsdp=True: {half} parameters sharded, no master weights; gradients reduced in float32."]

    def shard(self, model: nn.Module) -> Dict[torch.Tensor, torch.Tensor]:
        """Broadcast rank 0's state, then ``fully_shard`` bottom-up: float32 islands, blocks,
        the root. Returns ``{parameter before: sharded parameter}``."""
        from torch.distributed.fsdp import FSDPModule, fully_shard

        from .._model.batchnorm import enable_mixed_input_batchnorm

        where = {id(p): (m, n) for m in model.modules() for n, p in m._parameters.items() if p is not None}
        before = {id(p): p for p in model.parameters()}
        _broadcast_from_first_rank(model, self.shard_kwargs.get("mesh"))
        guard_exit()
        if self.half_model:
            for m in model.modules():
                if _keeps_float32(m, self.keep_bn) and any(p is not None for p in m._parameters.values()):
                    fully_shard(m, mp_policy=self.float32_policy, **self.shard_kwargs)
            if self.keep_bn:
                enable_mixed_input_batchnorm(model)
        if self.blocks:
            matched = [m for m in model.modules() if isinstance(m, self.blocks) and m is not model]
            unused = [c.__name__ for c in self.blocks if not any(isinstance(m, c) for m in matched)]
            if unused:
                warnings.warn(f"initialize(fsdp_kwargs={{'blocks': ...}}): no submodule is a {', '.join(unused)}; "
                              f"those classes have no effect.", NoEffectWarning, stacklevel=4)
            for m in reversed(matched):  # children before their parents
                if not isinstance(m, FSDPModule):
                    fully_shard(m, mp_policy=self.block_policy, **self.shard_kwargs)
        fully_shard(model, mp_policy=self.root_policy, **self.shard_kwargs)
        state = getattr(model, "_ampkit", None)
        if state is not None:
            state.sharded = True
            state.fsdp_root = weakref.ref(model)
            state._param_ids = {id(p) for p in model.parameters()}
        return {before[i]: m._parameters[n] for i, (m, n) in where.items()}


def _broadcast_from_first_rank(model: nn.Module, mesh) -> None:
    """Every rank starts from rank 0's parameters and buffers, as with DDP. A model on the CPU
    under a group with no CPU backend (NCCL alone, with ``CPUOffloadPolicy``) goes through the
    current accelerator, one tensor at a time (``fully_shard`` moves it there next anyway)."""
    groups = [None] if mesh is None else [mesh.get_group(d) for d in range(mesh.ndim)]
    with torch.no_grad():
        for group in groups:
            src = 0 if group is None else dist.get_global_rank(group, 0)
            for t in list(model.parameters()) + list(model.buffers()):
                data = t.data
                on = data.to(collective_device(data.device, group))
                dist.broadcast(on, src, group=group)
                if on is not data:
                    data.copy_(on)


def plan(models, optimizers, props, fsdp, fsdp_kwargs, ddp, cast_model_outputs) -> Optional[Plan]:
    """Check the ``fsdp`` options of ``initialize`` against its models and optimizers.

    Returns the `Plan` for ``fsdp=True`` and None otherwise; raises (before anything is
    modified) on bad options and on the orders that cannot work.
    """
    if not isinstance(fsdp, bool):
        raise TypeError(f"initialize(fsdp={fsdp!r}): expected True or False.")
    if fsdp_kwargs is not None and not fsdp:
        raise ValueError("initialize(fsdp_kwargs=...): only used with fsdp=True.")
    half_model = props.cast_model_type in HALF_DTYPES
    if not fsdp:
        for m in models:
            if half_model and is_sharded(m):
                raise RuntimeError(
                    f"initialize(models=...): the model was already sharded with fully_shard; at {props.opt_level} "
                    f"the model is cast to half, which FSDP2 would undo (it all-gathers its own fp32 shards). Pass "
                    f"the unsharded model with initialize(..., fsdp=True), which shards it with this level's "
                    f"MixedPrecisionPolicy."
                )
        return None
    if ddp:
        raise ValueError("initialize(ddp=True, fsdp=True): choose one; FSDP2 already reduces gradients across ranks.")
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "initialize(fsdp=True): the default process group is not initialized; call "
            "torch.distributed.init_process_group(...) first (torchrun sets up the environment)."
        )
    kwargs = {} if fsdp_kwargs is None else fsdp_kwargs
    if not isinstance(kwargs, dict):
        raise TypeError(f"initialize(fsdp_kwargs={fsdp_kwargs!r}): expected a dict or None.")
    unknown = sorted(set(kwargs) - set(FSDP_KWARGS))
    if unknown:
        hint = " (the opt level sets the MixedPrecisionPolicy)" if "mp_policy" in unknown else ""
        raise ValueError(f"initialize(fsdp_kwargs=...): unknown key(s) {unknown}{hint}; accepted: {list(FSDP_KWARGS)}.")
    blocks = kwargs.get("blocks", ())
    if not (isinstance(blocks, (list, tuple)) and all(isinstance(c, type) and issubclass(c, nn.Module) for c in blocks)):
        raise TypeError(
            f"initialize(fsdp_kwargs={{'blocks': {blocks!r}}}): expected a list of nn.Module subclasses, each "
            f"instance of which becomes its own fully_shard group (e.g. [TransformerBlock])."
        )
    rsf = kwargs.get("reshard_after_forward")
    if not (rsf is None or isinstance(rsf, int)):
        raise TypeError(f"initialize(fsdp_kwargs={{'reshard_after_forward': {rsf!r}}}): expected True, False, an int or None.")
    mesh = kwargs.get("mesh")
    if mesh is not None:
        from torch.distributed.device_mesh import DeviceMesh

        if not isinstance(mesh, DeviceMesh):
            raise TypeError(f"initialize(fsdp_kwargs={{'mesh': {mesh!r}}}): expected a torch DeviceMesh or None.")
    _check_offload(kwargs.get("offload_policy"))
    for m in models:
        if is_sharded(m):
            raise RuntimeError(
                "initialize(fsdp=True): the model was already sharded with fully_shard; pass the unsharded model "
                "(initialize applies fully_shard itself, per block and to the root)."
            )
    for opt in optimizers:
        if opt.state:
            raise ValueError(
                f"initialize(fsdp=True): {type(opt).__name__} already has state for {len(opt.state)} parameter(s), "
                f"which sharding would strand; create the optimizer fresh and load its state after initialize "
                f"(ampkit.parallel.load_sharded)."
            )
    return Plan(props, kwargs, cast_model_outputs)


def _check_offload(policy) -> None:
    """``fsdp_kwargs["offload_policy"]``: a torch ``OffloadPolicy``; pinned memory needs an
    accelerator (FSDP2 would fail half-way through sharding without one)."""
    if policy is None:
        return
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    if not isinstance(policy, OffloadPolicy):
        raise TypeError(f"initialize(fsdp_kwargs={{'offload_policy': {policy!r}}}): expected a torch.distributed.fsdp."
                        f"CPUOffloadPolicy (or OffloadPolicy(), no offload).")
    if isinstance(policy, CPUOffloadPolicy) and policy.pin_memory and not torch.accelerator.is_available():
        raise ValueError(f"initialize(fsdp_kwargs={{'offload_policy': {policy!r}}}): pinned memory needs an "
                         f"accelerator and none is available; pass CPUOffloadPolicy(pin_memory=False).")


def adopt_sharded(optimizer: torch.optim.Optimizer, sharded: Dict[torch.Tensor, torch.Tensor]) -> None:
    """Point ``optimizer`` at the sharded parameters that replaced the ones it was built with."""
    for group in optimizer.param_groups:
        group["params"] = [sharded.get(p, p) for p in group["params"]]


def check_not_resharded(module: nn.Module) -> None:
    """Raise if ``fully_shard`` was applied after ``initialize``, to the model or to a module
    around it (a DDP wrapper); called by the ``__call__`` that `check_calls` gives the
    classes ``fully_shard`` swaps in, and from the model's forward when FSDP2 marked it as
    managed."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is not None and (isinstance(module, fsdp.FSDPModule) or module.__dict__.get("_is_fsdp_managed_module")):
        raise RuntimeError(
            f"{type(module).__name__}: fully_shard was applied after ampkit.initialize; its optimizer still holds "
            f"the parameters from before sharding, so nothing would train. Pass the unsharded model to "
            f"ampkit.initialize(model, optimizer, opt_level=..., fsdp=True) instead."
        )


def check_calls(cls: type) -> None:
    """Give ``cls``, a class that ``fully_shard`` put in front of an ampkit class, a ``__call__``
    that runs `check_not_resharded` first: before FSDP2's forward hooks, whose lazy init
    would refuse a model with float32 BatchNorm in a half model with an AssertionError of its
    own. Models that ``initialize(..., fsdp=True)`` sharded pass."""
    call = cls.__call__

    def __call__(self, *args, **kwargs):
        state = self.__dict__.get("_ampkit")
        if state is None or not state.sharded:
            check_not_resharded(self)
        return call(self, *args, **kwargs)

    cls.__call__ = __call__


# -- checkpoints ---------------------------------------------------------------------------

def _dcp():
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict as sd

    return dcp, sd


class _MetadataOnly(pickle.Unpickler):
    """Unpickles only what ``dcp.save`` writes into ``.metadata``: DCP's own records, torch sizes,
    dtypes and layouts, paths, plain containers. Anything else is refused before DCP unpickles it."""

    MODULES = ("torch.distributed.checkpoint.",)
    NAMES = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
             ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
             ("pathlib", "PureWindowsPath"), ("pathlib", "Path")}

    def find_class(self, module, name):
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if module.startswith(self.MODULES) or (module, name) in self.NAMES or dtype:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name}")


def check_metadata(checkpoint_id) -> None:
    """Refuse a ``.metadata`` file that is not what torch's distributed checkpoint writes
    (torch unpickles it: a crafted one could run code); a cheap, partial check."""
    if not isinstance(checkpoint_id, (str, os.PathLike)):
        return  # a storage reader: its own business
    path = os.path.join(os.fspath(checkpoint_id), ".metadata")
    if not os.path.isfile(path):
        return  # DCP reports the missing file itself
    try:
        with open(path, "rb") as f:
            _MetadataOnly(f).load()
    except Exception as e:
        raise ValueError(
            f"ampkit.parallel.load_sharded({os.fspath(checkpoint_id)!r}): {path} is not the metadata that "
            f"torch.distributed.checkpoint writes ({type(e).__name__}: {e}); refusing to let torch unpickle it. "
            f"Load only checkpoints you wrote or trust."
        ) from None


def save_sharded(checkpoint_id, model: nn.Module, optimizer: torch.optim.Optimizer, extra: Optional[dict] = None) -> None:
    """Save model, optimizer and loss scalers with ``torch.distributed.checkpoint``: each rank
    writes its own shards (collective: call on every rank).

    ``checkpoint_id``: the checkpoint's directory (or anything ``dcp.save`` takes as one);
    ``model``, ``optimizer``: as ``initialize(..., fsdp=True)`` returned them; ``extra``: a dict
    of what else belongs to the run (tensors, DTensors such as an EMA's shards, plain values),
    saved under ``"extra"``. The directory is marked incomplete until every rank has written its
    part: `load_sharded` refuses a checkpoint whose save did not finish.
    """
    run = registry.of_optimizer("ampkit.parallel.save_sharded()", optimizer)
    _check_extra("save_sharded", extra)
    dcp, sd = _dcp()
    model_state, optim_state = sd.get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optim_state, "amp": run.state_dict(),
             "run": reshard.describe(run.properties, _shards(optimizer)[1])}
    if extra is not None:
        state["extra"] = extra
    with reshard.writing(checkpoint_id):
        dcp.save(state, checkpoint_id=checkpoint_id)


def load_sharded(checkpoint_id, model: nn.Module, optimizer: torch.optim.Optimizer, extra: Optional[dict] = None) -> None:
    """Load what `save_sharded` wrote under ``checkpoint_id`` into a model and optimizer
    prepared by ``initialize(..., fsdp=True)``: on any number of ranks and mesh shape, and at
    any level (the state is float32; see the README's resume rules). The same level on the
    same number of shards resumes bit-exactly, and the O7/O8 rounding continues from the saved
    seed and step on any shard layout. ``extra``: a dict shaped like the
    one saved (its tensors laid out as this run wants them), loaded in place."""
    caller = "ampkit.parallel.load_sharded"
    run = registry.of_optimizer(f"{caller}()", optimizer)
    _check_extra("load_sharded", extra)
    check_metadata(checkpoint_id)
    reshard.check_complete(checkpoint_id)
    dcp, sd = _dcp()
    saved = _saved_run_state(checkpoint_id, run, optimizer)  # checked before anything changes
    model_state, optim_state = sd.get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optim_state}
    if saved is None:  # not a directory (a storage reader): the keys of this run
        state["amp"] = run.state_dict()
    if extra is not None:
        state["extra"] = extra
    _dcp_load(state, checkpoint_id, saved, run, optimizer)
    amp = saved["amp"] if saved is not None else state["amp"]
    sd.set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    run.load_state_dict(amp, caller)
    if run.rounder is not None and ROUNDING_KEY not in amp:  # from a level without rounding (O5): a fresh start
        run.rounder.manual_seed(run.rounder.seed)  # get_state_dict's initializing step may have advanced it


def _saved_run_state(checkpoint_id, run, optimizer) -> Optional[dict]:
    """The checkpoint's ``"run"`` record and its ``"amp"`` entry, read with the keys that were
    saved (an older O7/O8 checkpoint's per-shard generator rows too, which the rounder checks
    and ignores) and checked against ``run``; None where ``checkpoint_id`` is not a checkpoint
    directory."""
    metadata = reshard.saved_metadata(checkpoint_id)
    if metadata is None:
        return None
    state = {k: reshard.saved_template(metadata, k) for k in ("amp", "run")}
    state = {k: v for k, v in state.items() if v is not None}
    _dcp_load(state, checkpoint_id, None, run, optimizer)
    state.setdefault("amp", {})
    if run.rounder is None:  # a level without rounding: nothing to continue (as ampkit.checkpoint.load)
        state["amp"].pop(ROUNDING_KEY, None)
    run.check_state(state["amp"], "ampkit.parallel.load_sharded")
    return state


def _dcp_load(state: dict, checkpoint_id, saved: Optional[dict], run, optimizer) -> None:
    """``dcp.load`` whose errors (a missing key, another shape) name the levels on both sides."""
    dcp, _ = _dcp()
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    try:
        dcp.load(state, checkpoint_id=checkpoint_id)
    except (Exception, CheckpointException) as e:
        raise ValueError(
            f"ampkit.parallel.load_sharded({_name(checkpoint_id)!r}): {_levels((saved or state).get('run'), run, optimizer)}: "
            f"the checkpoint does not fit this model and optimizer ({type(e).__name__}: {e})") from e


def _check_extra(caller: str, extra) -> None:
    if extra is not None and not isinstance(extra, dict):
        raise TypeError(f"ampkit.parallel.{caller}(extra={type(extra).__name__}): expected a dict (e.g. "
                        f"{{'ema': ema_shards, 'step': step}}) or None.")


def _name(checkpoint_id):
    return os.fspath(checkpoint_id) if isinstance(checkpoint_id, (str, os.PathLike)) else checkpoint_id


def _shards(optimizer: torch.optim.Optimizer):
    """``(this rank's shard index, number of shards)`` along the parameters' sharding
    dimension; ``(0, 1)`` for unsharded parameters."""
    ref = next((p for g in optimizer.param_groups for p in g["params"] if is_dtensor(p)), None)
    if ref is None:
        return 0, 1
    dim = next((d for d, pl in enumerate(ref.placements) if pl.is_shard()), None)
    if dim is None:
        return 0, 1
    return ref.device_mesh.get_local_rank(dim), ref.device_mesh.size(dim)


def _levels(saved, run, optimizer) -> str:
    """Both sides of a load, for errors: \"written at O5 on 2 shards, loaded at O7 on 4\"."""
    mine = f"loaded at {reshard.level_name(run.properties)} on {_shards(optimizer)[1]} shard(s)"
    if not isinstance(saved, dict) or not isinstance(saved.get("level"), str):
        return f"written by an earlier ampkit (level not recorded), {mine}"
    return f"written at {saved['level']} on {saved.get('shards')} shard(s), {mine}"


def full_state_dict(model: nn.Module) -> dict:
    """For export: the whole model as one float32 state dict on CPU, on rank 0 (an empty dict on
    the other ranks). Collective: call on every rank."""
    _, sd = _dcp()
    full = sd.get_model_state_dict(model, options=sd.StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.float() if torch.is_tensor(v) and v.dtype in HALF_DTYPES else v for k, v in full.items()}
