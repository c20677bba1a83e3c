"""Apex's ``DistributedDataParallel`` on top of ``torch.nn.parallel.DistributedDataParallel``.

Torch's reducer does the bucketing, the overlap of communication with backward, and
``no_sync``; a communication hook gives each bucket Apex's arithmetic (optional fp32
allreduce, pre-division, averaging), and with ``delay_allreduce`` holds every bucket
back until the end of backward.
"""
import collections
import inspect
import sys
import warnings

import torch
import torch.distributed as dist
from torch.autograd import Variable

from .._common.errors import NoEffectWarning
from .clean_exit import guard_exit
from .ddp_windows import watch

__all__ = ["DistributedDataParallel"]

_HALF = (torch.float16, torch.bfloat16)
_reported = set()  # options already reported as having no effect, once per process
# torch 2.13 renamed broadcast_buffers (buffers are then still broadcast once, at construction).
_NO_BUFFER_SYNC = {
    "forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(torch.nn.parallel.DistributedDataParallel).parameters
    else "broadcast_buffers": False
}


_MESSAGE_SIZE = 10_000_000  # message_size's default
_TORCH_OPTIONS = [n for n in inspect.signature(torch.nn.parallel.DistributedDataParallel).parameters if n != "module"]


def _report_no_effect(name: str, why: str) -> None:
    if name not in _reported:
        _reported.add(name)
        warnings.warn(f"DistributedDataParallel({name}=...) has no effect on top of torch DDP: {why}", NoEffectWarning, stacklevel=3)


class _Reduction:
    """Communication-hook state: how one bucket is reduced across the group."""

    def __init__(self, group, fp32: bool, predivide: float, average: bool):
        self.group = group
        self.fp32 = fp32
        self.predivide = predivide
        self.postmultiply = predivide / dist.get_world_size(group) if average else 1.0
        self.held_back = []  # (buffer, future) of buckets held back until the end of backward

    def reduce(self, buffer: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
        """Apex's order: optional fp32 copy, ``* 1/f``, sum over ranks, ``* f/world_size``."""
        t = buffer.float() if self.fp32 and buffer.dtype in _HALF else buffer
        if self.predivide != 1.0:
            t.mul_(1.0 / self.predivide)
        work = dist.all_reduce(t, group=self.group, async_op=True)

        def finish(_):
            if self.postmultiply != 1.0:
                t.mul_(self.postmultiply)
            return buffer if t is buffer else buffer.copy_(t)

        return work.get_future().then(finish)

    def flush(self) -> None:
        """End of backward: reduce every held-back bucket, then release torch's reducer."""
        pending, self.held_back = self.held_back, []
        for reduced, held in [(self.reduce(buffer), held) for buffer, held in pending]:
            held.set_result(reduced.wait())


def _allreduce_hook(state: _Reduction, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    return state.reduce(bucket.buffer())


def _delayed_hook(state: _Reduction, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    # Torch's reducer hands buckets over in index order and queues its own end-of-backward
    # step (which waits on these futures) after the last one: our callback, queued at
    # bucket 0, runs before it.
    if bucket.index() == 0:
        state.held_back = []
        Variable._execution_engine.queue_callback(state.flush)
    buffer = bucket.buffer()
    held = torch.futures.Future(devices=[buffer.device] if buffer.is_cuda else None)  # CUDA: stream-safe hand-over
    state.held_back.append((buffer, held))
    return held


def _bucket_cap_mb(module: torch.nn.Module, message_size: int, delay_allreduce: bool) -> float:
    """``message_size`` elements of the dtype holding most parameters, in MiB (delayed: one bucket per dtype)."""
    params = [p for p in module.parameters() if p.requires_grad]
    if delay_allreduce:
        return sum(p.numel() * p.element_size() for p in params) / 2**20 + 1
    numel = collections.Counter()
    for p in params:
        numel[p.element_size()] += p.numel()
    return message_size * max(numel, key=numel.get) / 2**20


def _torch_options(module, options: dict, message_size: int, delay_allreduce: bool, retain: bool) -> dict:
    """torch DDP's keywords: ``options`` (torch's own, checked against Apex's), with the bucket size,
    the bucket view and the buffer sync Apex's options set."""
    unknown = sorted(set(options) - set(_TORCH_OPTIONS))
    if unknown:
        raise TypeError(f"DistributedDataParallel({unknown[0]}=...): no such argument; expected Apex's options or "
                        f"torch DistributedDataParallel's: {', '.join(_TORCH_OPTIONS)}.")
    if options.get("mixed_precision") is not None:
        raise ValueError("DistributedDataParallel(mixed_precision=...): ampkit does the mixed precision "
                         "(ampkit.initialize); expected None.")
    if "bucket_cap_mb" in options and (delay_allreduce or message_size != _MESSAGE_SIZE):
        other = "delay_allreduce=True" if delay_allreduce else f"message_size={message_size}"
        raise ValueError(f"DistributedDataParallel(bucket_cap_mb={options['bucket_cap_mb']!r}, {other}): both set "
                         f"the bucket size; give one.")
    if retain and options.get("gradient_as_bucket_view") is False:
        raise ValueError("DistributedDataParallel(retain_allreduce_buffers=True, gradient_as_bucket_view=False): "
                         "Apex's and torch's name of one option, with two values; give one.")
    out = {"bucket_cap_mb": _bucket_cap_mb(module, message_size, delay_allreduce), **options,
           "gradient_as_bucket_view": bool(retain or options.get("gradient_as_bucket_view"))}
    if not {"broadcast_buffers", "forward_sync_buffers"} & set(options):
        out.update(_NO_BUFFER_SYNC)
    return out


class DistributedDataParallel(torch.nn.parallel.DistributedDataParallel):
    """Apex's ``apex.parallel.DistributedDataParallel``, built on torch's.

    Parameters (and buffers, and the fp32 master weights of a model that went through
    ``ampkit.initialize``) are broadcast from rank 0 at construction; buffers are not
    synchronised in forward (as in Apex: use `SyncBatchNorm` for BN statistics).
    Each gradient bucket is reduced as ``sum_r(g_r * 1/f) * f/world_size`` with
    ``f = gradient_predivide_factor`` (the last factor only if ``gradient_average``), in
    float32 for half buckets if ``allreduce_always_fp32``. ``message_size`` (elements)
    sets torch's bucket size; ``delay_allreduce`` reduces everything at the end of
    backward, one bucket per dtype; ``retain_allreduce_buffers`` makes gradients views
    into the bucket buffers. ``disable_allreduce()`` / ``enable_allreduce()`` switch
    reduction off and on for gradient accumulation, from the next forward on (torch's
    ``no_sync``). torch DDP's own keywords (``find_unused_parameters``, ``static_graph``,
    ``gradient_as_bucket_view``, ``bucket_cap_mb`` instead of ``message_size``,
    ``broadcast_buffers``, ...) are passed on to it.

    Args:
        module: the model (already through ``ampkit.initialize``, if used).
        message_size: bucket size in elements.
        delay_allreduce: reduce all gradients at the end of backward instead of overlapping.
        allreduce_trigger_params: accepted for Apex compatibility; torch DDP decides when
            buckets are ready (reported with a NoEffectWarning).
        retain_allreduce_buffers: gradients become views into the bucket buffers.
        allreduce_always_fp32: reduce half buckets in float32.
        num_allreduce_streams: several reduction streams (CUDA).
        allreduce_communicators: ``(process_groups, streams)`` for those streams (CUDA).
        gradient_average: divide the summed gradients by the world size.
        gradient_predivide_factor: divide by this before the sum, multiply after.
        gradient_average_split_factor: accepted for Apex compatibility, no effect (NoEffectWarning).
        prof: accepted for Apex compatibility, no effect (NoEffectWarning).
        shared_param: removed in Apex; refused with the replacement to use.
        options: torch ``DistributedDataParallel``'s keywords (not ``mixed_precision``: ampkit's).
    """

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        fsdp = sys.modules.get("torch.distributed.fsdp")
        if fsdp is not None and issubclass(cls, fsdp.FSDPModule):  # fully_shard on this wrapper
            from .fsdp import check_calls

            check_calls(cls)

    def __init__(
        self,
        module: torch.nn.Module,
        message_size: int = _MESSAGE_SIZE,
        delay_allreduce: bool = False,
        allreduce_trigger_params=None,
        retain_allreduce_buffers: bool = False,
        allreduce_always_fp32: bool = False,
        num_allreduce_streams: int = 1,
        allreduce_communicators=None,
        gradient_average: bool = True,
        gradient_predivide_factor: float = 1.0,
        gradient_average_split_factor=None,
        prof: bool = False,
        *,
        shared_param=None,
        **options,
    ):
        if shared_param is not None:
            raise ValueError(
                "shared_param is no longer supported (it was misleadingly named: overlapping communication "
                "with backward works with shared parameters); use delay_allreduce=True to reduce at the end of backward."
            )
        if isinstance(num_allreduce_streams, bool) or not isinstance(num_allreduce_streams, int) or num_allreduce_streams < 1:
            raise ValueError(f"num_allreduce_streams={num_allreduce_streams!r}: expected an integer >= 1.")
        if num_allreduce_streams > 1 and delay_allreduce:
            raise ValueError("num_allreduce_streams > 1 may only be used if delay_allreduce=False.")
        if allreduce_trigger_params is not None and delay_allreduce:
            raise ValueError("Setting allreduce_trigger_params is only valid if delay_allreduce=False.")
        if allreduce_communicators is not None and not (
            num_allreduce_streams > 1
            and len(allreduce_communicators) == 2
            and len(allreduce_communicators[0]) == len(allreduce_communicators[1]) == num_allreduce_streams
        ):
            raise ValueError(
                "allreduce_communicators must be (process_groups, streams), each of length num_allreduce_streams > 1."
            )
        if isinstance(message_size, bool) or not isinstance(message_size, int) or message_size < 1:
            raise ValueError(f"message_size={message_size!r}: expected a positive number of elements.")
        if not gradient_predivide_factor > 0:
            raise ValueError(f"gradient_predivide_factor={gradient_predivide_factor!r}: expected a positive number.")
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "DistributedDataParallel: the default process group is not initialized; call "
                "torch.distributed.init_process_group(...) first (torchrun sets up the environment)."
            )
        for name, value, why in (
            ("allreduce_trigger_params", allreduce_trigger_params is not None, "buckets are formed by message_size"),
            ("num_allreduce_streams", num_allreduce_streams > 1, "torch DDP reduces on its process group's own stream"),
            ("allreduce_communicators", allreduce_communicators is not None, "torch DDP uses the default process group"),
            ("gradient_average_split_factor", gradient_average_split_factor is not None, "unused in Apex as well; use gradient_predivide_factor"),
            ("prof", bool(prof), "torch.profiler already records DDP's reductions"),
        ):
            if value:
                _report_no_effect(name, why)
        super().__init__(module, **_torch_options(module, options, message_size, delay_allreduce, retain_allreduce_buffers))
        # ampkit.initialize ran first: its fp32 master weights must start equal on every rank too.
        for master in getattr(getattr(module, "_ampkit", None), "masters", {}).values():
            dist.broadcast(master.detach(), 0, group=self.process_group)
        state = _Reduction(self.process_group, bool(allreduce_always_fp32), float(gradient_predivide_factor), bool(gradient_average))
        self.register_comm_hook(state, _delayed_hook if delay_allreduce else _allreduce_hook)
        self._ampkit_reduction = state  # an accumulation window's sum is reduced with the same arithmetic
        if hasattr(module, "_ampkit"):
            watch(self, module._ampkit)
        guard_exit()

    def enable_allreduce(self) -> None:
        """Reduce gradients again from the next forward on (after gradient accumulation)."""
        self.require_backward_grad_sync = True

    def disable_allreduce(self) -> None:
        """Accumulate gradients locally, without communication, from the next forward on."""
        self.require_backward_grad_sync = False
