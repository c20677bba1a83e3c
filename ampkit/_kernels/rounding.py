"""Stochastic rounding of float32 to bfloat16: from counter bits (O7), or from a generator.

Design (the rounding, and the generator's 8 bits per element): docs/design/memory-levels.md, "Stochastic rounding".
"""
from typing import List, Optional

import torch
from torch._utils import _unflatten_dense_tensors

from . import counter_bits, native
from .counter_bits import Index
from .flat import flat

__all__ = ["round_to_bf16_", "round_all_to_bf16_", "round_counter_", "StochasticRounder"]

_PER_WORD = 4  # 16-bit draws per 64-bit word
_HALF = 1 << 15
_KEEP = -(1 << 16)  # as int32: 0xFFFF0000, the float32 bits bfloat16 keeps
BLOCK = 1 << 15  # elements per block of the eager counter-bit kernels


def round_to_bf16_(dst: torch.Tensor, src: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Write float32 ``src`` into bfloat16 ``dst`` (same shape), rounded stochastically with
    random bits from ``generator`` (the device's default generator when ``None``)."""
    round_all_to_bf16_([dst], [src.clone()], generator)
    return dst


def round_all_to_bf16_(dsts: List[torch.Tensor], srcs: List[torch.Tensor], generator: Optional[torch.Generator] = None) -> None:
    """``round_to_bf16_`` of each fp32 ``srcs[i]`` into the bf16 ``dsts[i]``, for tensors on one device,
    with one generator call, as one flat run of their elements (the same result as rounding their
    concatenation); ``srcs`` are used as scratch (their values may be lost)."""
    for d, s in zip(dsts, srcs):
        if s.dtype != torch.float32 or d.dtype != torch.bfloat16:
            raise TypeError(f"round_to_bf16_: expected a bfloat16 dst and a float32 src, got {d.dtype} and {s.dtype}.")
    if not srcs:
        return
    run = flat(srcs)
    n = run.numel()
    if n == 0:
        return
    h = (n + 1) // 2
    words = torch.empty(-(-h // _PER_WORD), dtype=torch.int64, device=run.device).random_(-2**63, None, generator=generator)
    draws = words.view(torch.int16)[:h]  # signed: with _HALF added below, uniform in [0, 65536)
    bits = run.view(torch.int32)
    bits[:h].add_(draws)
    bits[h:].add_(torch.mul(draws[:n - h], 257))  # the partners' draws: 257 d, wrapping in 16 bits
    bits.add_(_HALF).bitwise_and_(_KEEP)
    torch._foreach_copy_(dsts, _unflatten_dense_tensors(run, dsts))  # exact: the dropped bits are zero


def round_counter_(dst: torch.Tensor, src: torch.Tensor, seed: int, step: int, tensor: int, stream: int,
                   index: Index, lib=None, paired: bool = False) -> torch.Tensor:
    """Write float32 ``src`` into bfloat16 ``dst`` (same shape), rounded stochastically with the
    counter bits of ``(seed, step, tensor, element, stream)``: the element indices are
    ``index + k`` for the ``k``-th element of ``src`` in row-major order, or ``index`` itself
    (an int64 tensor of ``src``'s size); ``paired`` (O8's weights with one 8-bit state, stream 0):
    `counter_bits.paired16`'s bits. With ``lib`` (``native.library()``) on CPU in one pass of its
    C kernel, else in torch ops (the same bits); ``src`` may be overwritten."""
    if src.dtype != torch.float32 or dst.dtype != torch.bfloat16 or src.shape != dst.shape:
        raise TypeError(f"round_counter_: expected a bfloat16 dst and a float32 src of one shape, got "
                        f"{dst.dtype} {tuple(dst.shape)} and {src.dtype} {tuple(src.shape)}.")
    if paired and stream != 0:
        raise ValueError(f"round_counter_(paired=True, stream={stream}): the paired bits round weights, stream 0.")
    n = src.numel()
    if n == 0:
        return dst
    run = src.reshape(-1)
    out = dst.view(-1) if dst.is_contiguous() else torch.empty(n, dtype=torch.bfloat16, device=dst.device)
    if lib is not None and isinstance(index, int) and src.device.type == "cpu":
        args = (native.ptr(run), native.ptr(out), n, index,
                counter_bits.key(seed, step, tensor, stream // 4))
        if paired:
            lib.round_bf16_paired(*args, native.threads(n))
        else:
            lib.round_bf16(*args, counter_bits.shift16(stream), native.threads(n))
    else:
        index = index.reshape(-1).to(src.device) if torch.is_tensor(index) else index
        bits = run.view(torch.int32)
        draws = counter_bits.paired16 if paired else counter_bits.draws16
        for lo in range(0, n, BLOCK):  # blocks that stay in cache: 10x faster than whole-tensor int64 passes
            hi = min(n, lo + BLOCK)
            at = index[lo:hi] if torch.is_tensor(index) else index + lo
            bits[lo:hi].add_(draws(seed, step, tensor, stream, at, hi - lo, src.device)).bitwise_and_(_KEEP)
        out.copy_(run)  # exact: the dropped bits are zero
    if out.data_ptr() != dst.data_ptr():
        dst.copy_(out.view(dst.shape))
    return dst


class StochasticRounder:
    """The run's rounding randomness: a seed and a step counter, all of its state
    (``state_dict``), so resume is bit-exact.

    `round_` (O7's and O8's weights, O7's half state) and O8's 8-bit codes
    (``_update/state_8bit.py``) take their bits from ``counter_bits.py``: a pure
    function of ``(seed, step, tensor, element, stream)``, the same for any chunking, thread
    count, shard layout or world size. ``step`` counts the optimizer steps that rounded
    (`advance`; a skipped step does not).
    """

    def __init__(self, seed: int = 0):
        self.seed = _check_seed(seed)
        self.step = 0

    def round_(self, dsts: List[torch.Tensor], srcs: List[torch.Tensor], tensors: List[int],
               index: List[Index], stream: int = 0, paired: bool = False) -> None:
        """``dsts[i] = srcs[i]`` (float32 into bfloat16) rounded stochastically with the bits of
        ``(seed, step, tensors[i], element, stream)``, where ``index[i]`` is the index of the
        first element of ``srcs[i]`` in its full parameter (or every element's, an int64
        tensor); ``paired``: `round_counter_`'s; ``srcs`` may be overwritten."""
        lib = native.library() if any(s.device.type == "cpu" for s in srcs) else None
        for dst, src, tensor, first in zip(dsts, srcs, tensors, index):
            round_counter_(dst, src, self.seed, self.step, tensor, stream, first, lib, paired)

    def advance(self) -> None:
        """One more step rounded: the next `round_` draws new bits."""
        self.step += 1

    def manual_seed(self, seed: int) -> None:
        """Restart from ``seed`` at step 0."""
        self.seed = _check_seed(seed)
        self.step = 0

    def state_dict(self) -> dict:
        return {"seed": self.seed, "step": self.step}

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict` output, checked whole first (`check_state`). An
        older state also holds ``"generators"`` (per-device generator states, from when O7
        and O8 drew from them): they are checked and ignored, and the run continues from
        the saved seed at the saved step (step 0 in a state saved before the step counter
        existed: its run drew its bits from the generators, so none repeat)."""
        self.check_state("stochastic_rounding", state)
        self.seed = state["seed"]
        self.step = state.get("step", 0)

    @staticmethod
    def check_state(name: str, state) -> None:
        """ValueError naming the key where ``state`` is not a rounder state: ``{"seed", "step"}``,
        or an older one with ``"generators"`` (a dict of uint8 tensors keyed by device) and
        perhaps no ``"step"``."""
        if not isinstance(state, dict) or "seed" not in state or not set(state) <= {"seed", "step", "generators"}:
            raise ValueError(f"{name}: expected a dict with 'seed' and 'step' (older: and 'generators'), got {state!r}.")
        _check_seed(state["seed"], f"{name}['seed']")
        step = state.get("step", 0)
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"{name}['step']={step!r}: expected a non-negative integer.")
        generators = state.get("generators", {})
        if not isinstance(generators, dict):
            raise ValueError(f"{name}['generators']: expected a dict of generator states, got {type(generators).__name__}.")
        for key, value in generators.items():
            try:
                torch.device(key)
            except (RuntimeError, TypeError):
                raise ValueError(f"{name}['generators']: {key!r} is not a device.") from None
            if not (torch.is_tensor(value) and value.dtype == torch.uint8):
                raise ValueError(f"{name}['generators'][{key!r}]: expected a generator state (uint8 tensor).")


def _check_seed(seed, name: str = "seed") -> int:
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ValueError(f"{name}={seed!r}: expected an integer in [0, 2**63).")
    return seed
