"""What the precision report measures: up to two fp32 training steps on a copy, with hooks.

Every tensor a hook sees is reduced at once to a `Stats`: its element count, its
non-finite count, its largest finite magnitude, and a histogram of its magnitudes with three
bins per float32 binade (see `magnitude_keys`), whose edges are exactly the magnitudes at
which a value, multiplied by a loss scale ``2**k``, overflows float16 or rounds to zero there.
From those counts the share of elements that overflow or flush is exact for any of these
scales, so one pass serves every opt level; bfloat16's two edges, which fall inside a bin, are
counted exactly in a second pass over the tensor only when that bin holds something. Nothing
else of a tensor is kept.

Linear layers that O6 would convert are also run once through an emulated fp8 matmul
(``torch.float8_e4m3fn`` input and weight, one scale per tensor: amax maps to 448, as a
dynamic tensorwise recipe does) on the input the layer was called with, and compared with
the output it gave.
"""
import copy
import dataclasses
import itertools
import math
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

DYNAMIC_START = 2.0 ** 16  # where a "dynamic" loss scale starts (the opt-level table's O1/O2)
SCALE_EXPONENTS = tuple(range(16, -25, -1))  # float16 loss scales 2**16 down to 2**-24
FP16_OVERFLOW = 65520.0  # the smallest magnitude float16 rounds to inf (65504 + half an ulp)
FP16_FLUSH = 2.0 ** -25  # the largest magnitude float16 rounds to 0 (half its smallest subnormal)
BF16_OVERFLOW = (2.0 - 2.0 ** -8) * 2.0 ** 127
BF16_FLUSH = 2.0 ** -134
FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
DEFAULT_LR = 1e-3  # SGD's learning rate when no optimizer is given
FP8_ROWS = 256  # rows of a Linear's input (and output gradient) that its emulated fp8 figures sample

_MANTISSA = 23
_FP16_OVERFLOW_MANTISSA = 0x7FF000  # FP16_OVERFLOW * 2**k has this float32 mantissa for every k
_FINITE_MAX_BITS = 0x7F7FFFFF  # float32 max as int32
_BINS = 511  # magnitude_keys' range: 0 (zero) to 510 (the top of binade 254, and what was not finite)
_BF16_OVERFLOW_BITS = 0x7F7F8000  # bits of BF16_OVERFLOW
_BF16_FLUSH_BITS = 0x8000  # bits of BF16_FLUSH (a float32 subnormal)


def _bits(value: float) -> int:
    return torch.tensor(value, dtype=torch.float32).view(torch.int32).item()


def magnitude_keys(x: torch.Tensor, scratch: Optional["Scratch"] = None) -> torch.Tensor:
    """Each element's magnitude as a bin (int32, 0 to 510), two per float32 binade ``E``: bin
    ``2E+1`` holds the magnitudes above ``2**(E-127)`` and below the binade's ``FP16_OVERFLOW``
    edge (the one with ``FP16_OVERFLOW``'s mantissa), bin ``2E+2`` those from that edge up to
    ``2**(E-126)`` inclusive; bin 0 is zero. A non-finite element counts as the largest float32
    (bin 510). The result lives in ``scratch`` when one is given (valid until its next use)."""
    flat = x.reshape(-1).view(torch.int32)
    bits, past_edge = scratch.take(flat) if scratch is not None else (torch.empty_like(flat), torch.empty_like(flat))
    torch.bitwise_and(flat, 0x7FFFFFFF, out=bits).clamp_(max=_FINITE_MAX_BITS)
    torch.add(bits, (1 << _MANTISSA) - _FP16_OVERFLOW_MANTISSA, out=past_edge).bitwise_right_shift_(_MANTISSA)
    past_power = bits.add_((1 << _MANTISSA) - 1).bitwise_right_shift_(_MANTISSA)  # E + (mantissa > 0)
    return past_edge.add_(past_power)


class Scratch:
    """Two int32 buffers reused by every `magnitude_keys` call on one device, so counting
    allocates (and page-faults) nothing per tensor."""

    def __init__(self):
        self.buffers: Dict[torch.device, torch.Tensor] = {}

    def take(self, like: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        n, buf = like.numel(), self.buffers.get(like.device)
        if buf is None or buf.shape[1] < n:
            buf = self.buffers[like.device] = torch.empty(2, n, dtype=torch.int32, device=like.device)
        return buf[0, :n], buf[1, :n]


def _fp16_overflow_key(scale_exp: int) -> int:
    """Magnitudes at or above ``FP16_OVERFLOW * 2**-scale_exp`` are the bins from this key on."""
    return 2 * (_bits(FP16_OVERFLOW * 2.0 ** -scale_exp) >> _MANTISSA) + 2


def _fp16_flush_key(scale_exp: int) -> int:
    """Nonzero magnitudes at or below ``FP16_FLUSH * 2**-scale_exp`` are the bins 1 up to this key."""
    return 2 * (_bits(FP16_FLUSH * 2.0 ** -scale_exp) >> _MANTISSA)


@dataclasses.dataclass
class Stats:
    """Element counts of the tensors one hook saw (summed over calls and steps).

    ``hist[k]``: elements in `magnitude_keys` bin ``k``, the non-finite ones included (bin
    510); ``bf16_overflow`` / ``bf16_flush``: finite elements bfloat16 rounds to inf / nonzero
    ones it rounds to 0.
    """

    numel: int
    nonfinite: int
    amax: float
    hist: List[int]
    bf16_overflow: int = 0
    bf16_flush: int = 0

    @property
    def zeros(self) -> int:
        return self.hist[0]

    def overflow(self, dtype: str, scale: float = 1.0) -> float:
        """Share of elements that overflow ``dtype`` ("float16"/"bfloat16") once multiplied by ``scale``."""
        if dtype == "bfloat16" and scale == 1.0:
            return self.bf16_overflow / max(self.numel, 1)
        count = sum(self.hist[_fp16_overflow_key(self._exponent(dtype, scale)):]) - self.nonfinite
        return count / max(self.numel, 1)

    def flush(self, dtype: str, scale: float = 1.0) -> float:
        """Share of elements, nonzero in fp32, that round to zero in ``dtype`` once multiplied by ``scale``."""
        if dtype == "bfloat16" and scale == 1.0:
            return self.bf16_flush / max(self.numel, 1)
        return sum(self.hist[1:_fp16_flush_key(self._exponent(dtype, scale)) + 1]) / max(self.numel, 1)

    @staticmethod
    def _exponent(dtype: str, scale: float) -> int:
        e = math.log2(scale) if scale > 0 else math.nan
        if dtype != "float16" or e not in SCALE_EXPONENTS:
            raise ValueError(f"scale={scale!r}: expected a power of two from 2**-24 to 2**16 (1 for bfloat16).")
        return int(e)


def all_finite(t: torch.Tensor) -> torch.Tensor:
    """Whether every element of ``t`` is finite, as a device boolean (one pass, no copy)."""
    if t.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=t.device)
    return torch.isfinite(_amax(t.detach()))


def _amax(t: torch.Tensor) -> torch.Tensor:
    """The largest magnitude in ``t`` (NaN if it holds one, inf if an inf), from one ``aminmax`` pass."""
    lo, hi = torch.aminmax(t)
    return torch.maximum(-lo, hi)


class _Acc:
    """Running counts of one name, kept on the tensors' device until `stats`."""

    def __init__(self):
        self.hist: Optional[torch.Tensor] = None
        self.counts: Optional[torch.Tensor] = None  # numel, nonfinite, bf16 overflow, bf16 flush
        self.amax: Optional[torch.Tensor] = None

    def add(self, t: torch.Tensor, scratch: Optional[Scratch] = None) -> torch.Tensor:
        """Count ``t``; returns its number of non-finite elements (a device integer)."""
        x = t.detach().float()
        hist = torch.bincount(magnitude_keys(x, scratch), minlength=_BINS)
        amax, nonfinite, over, flush = self._tails(x, hist)
        counts = torch.stack([torch.tensor(x.numel(), device=x.device), nonfinite, over, flush])
        self.hist = hist if self.hist is None else self.hist + hist
        self.counts = counts if self.counts is None else self.counts + counts
        self.amax = amax if self.amax is None else torch.maximum(self.amax, amax)
        return nonfinite

    @staticmethod
    def _tails(x: torch.Tensor, hist: torch.Tensor):
        """Largest finite magnitude, non-finite count, bfloat16 overflow and flush counts: exact,
        from a second pass only where the histogram's top or bottom bins hold something."""
        zero = torch.zeros((), dtype=torch.int64, device=x.device)
        if x.numel() == 0:
            return torch.zeros((), device=x.device), zero, zero, zero
        top, tiny = hist[509:].sum().item(), hist[1].item()  # a sync (free on CPU) decides the passes
        nonfinite = over = flush = zero
        if top:
            a = x.abs().flatten()
            finite = torch.isfinite(a)
            nonfinite = (~finite).sum()
            a = torch.where(finite, a, torch.zeros((), device=a.device))
            amax = a.amax()
            over = (a.view(torch.int32) >= _BF16_OVERFLOW_BITS).sum()
        else:
            amax = _amax(x)
        if tiny:
            bits = x.flatten().view(torch.int32).bitwise_and(0x7FFFFFFF)
            flush = ((bits > 0) & (bits <= _BF16_FLUSH_BITS)).sum()
        return amax, nonfinite, over, flush

    def stats(self) -> Stats:
        numel, nonfinite, over, flush = self.counts.tolist()
        return Stats(numel, nonfinite, self.amax.item(), self.hist.tolist(), over, flush)


@dataclasses.dataclass
class Fp8:
    """Emulated fp8 of one Linear: matmul error against fp32 and the share of elements fp8 flushes."""

    matmul_error: float
    input_flush: float
    weight_flush: float
    grad_flush: Optional[float]


def fp8_qdq(t: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn, amax: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``t`` through ``dtype`` with one scale for the tensor (``amax``, by default ``t``'s largest
    magnitude, maps to the format's max), back in fp32."""
    t = t.detach().float()
    fmax = torch.finfo(dtype).max
    scale = fmax / (_amax(t) if amax is None else amax).clamp(min=1e-12)
    return (t * scale).clamp_(-fmax, fmax).to(dtype).float().div_(scale)


def _sample_rows(t: torch.Tensor) -> torch.Tensor:
    """At most `FP8_ROWS` evenly spaced rows of 2-d ``t``."""
    return t[::-(-t.shape[0] // FP8_ROWS)] if t.shape[0] > FP8_ROWS else t


class _Fp8Acc:
    """Squared error norms and flush counts of one Linear's emulated fp8 matmuls, on at most
    `FP8_ROWS` evenly spaced rows of each input (each tensor's scale from all of it)."""

    def __init__(self):
        self.sums: Dict[str, torch.Tensor] = {}

    def _add(self, key, value):
        self.sums[key] = value if key not in self.sums else self.sums[key] + value

    def forward(self, x: torch.Tensor, linear: nn.Linear, output) -> None:
        """The error of ``linear``'s matmul on input ``x`` in fp8 against the fp32 ``output`` it gave."""
        x, weight = x.detach().float().reshape(-1, x.shape[-1]), linear.weight.detach().float()
        x_max, w_max = _amax(x), _amax(weight)
        if not bool(torch.isfinite(x_max) & torch.isfinite(w_max)):
            return
        rows = _sample_rows(x)
        xq, wq = fp8_qdq(rows, amax=x_max), fp8_qdq(weight, amax=w_max)
        if isinstance(output, torch.Tensor) and output.dtype == torch.float32 and output.numel() == x.shape[0] * weight.shape[0]:
            ref = _sample_rows(output.detach().reshape(x.shape[0], -1))  # the layer's own fp32 matmul, plus its bias
            ref = ref - linear.bias.detach() if linear.bias is not None else ref
        else:
            ref = F.linear(rows, weight)
        self._add("err2", (F.linear(xq, wq) - ref).square().sum())
        self._add("ref2", ref.square().sum())
        for key, t, q in (("x", rows, xq), ("w", weight, wq)):
            self._add(key + "_flush", ((q == 0) & (t != 0)).sum())
            self._add(key + "_n", torch.tensor(t.numel(), device=t.device))

    def grad(self, g: torch.Tensor) -> None:
        g = g.reshape(-1, g.shape[-1]) if g.dim() > 1 else g.reshape(1, -1)
        g_max = _amax(g)
        if torch.isfinite(g_max):
            rows = _sample_rows(g)
            q = fp8_qdq(rows, torch.float8_e5m2, amax=g_max)
            self._add("g_flush", ((q == 0) & (rows != 0)).sum())
            self._add("g_n", torch.tensor(rows.numel(), device=g.device))

    def result(self) -> Optional[Fp8]:
        if "err2" not in self.sums:
            return None
        s = {k: v.item() for k, v in self.sums.items()}
        grad = s["g_flush"] / s["g_n"] if "g_n" in s else None
        return Fp8(math.sqrt(s["err2"] / max(s["ref2"], 1e-300)), s["x_flush"] / s["x_n"], s["w_flush"] / s["w_n"], grad)


@dataclasses.dataclass
class Measurements:
    """What `measure` saw, by name as ``named_modules()`` / ``named_parameters()`` give them.

    Attributes:
        modules: leaf module name -> class name, in model order.
        params: parameter name -> the name of the module that owns it.
        activations / output_grads: leaf module -> counts of its outputs / of their gradients.
        grads: parameter -> counts of its gradient.
        produced: leaf module -> non-finite outputs it made from finite inputs.
        lost: parameter -> {"bfloat16"/"float16": share of the nonzero elements of its fp32 update
            (the first applied step's) that a weight held in that dtype would lose under round-to-nearest}.
        fp8: Linear that O6 converts -> its emulated fp8 figures.
        losses, applied: per step, the loss and whether the step was applied (finite gradients).
        optimizer: what stepped (the user's optimizer class, or the default SGD).
    """

    modules: Dict[str, str]
    params: Dict[str, str]
    activations: Dict[str, Stats]
    output_grads: Dict[str, Stats]
    grads: Dict[str, Stats]
    produced: Dict[str, int]
    lost: Dict[str, Dict[str, float]]
    fp8: Dict[str, Fp8]
    losses: List[float]
    applied: List[bool]
    optimizer: str


def _tensors(obj) -> Iterable[torch.Tensor]:
    """The floating tensors in ``obj`` (nested tuples, lists, dicts)."""
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point():
            yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item)


def _owner(param_name: str) -> str:
    return param_name.rpartition(".")[0]


class Recorder:
    """Hooks on a model copy that reduce what they see to counts as it goes."""

    def __init__(self, model: nn.Module, fp8_names: Sequence[str]):
        self.model = model
        self.leaves = {n: m for n, m in model.named_modules() if next(m.children(), None) is None}
        self.acts = {n: _Acc() for n in self.leaves}
        self.out_grads = {n: _Acc() for n in self.leaves}
        self.grads = {n: _Acc() for n, _ in model.named_parameters()}
        self.produced: Dict[str, torch.Tensor] = {}
        self.fp8 = {n: _Fp8Acc() for n in fp8_names}
        self.fp8_on = True  # the emulated fp8 figures come from the first step only
        self.scratch = Scratch()
        self.lost: Dict[str, torch.Tensor] = {}  # parameter -> [moved, lost bf16, lost fp16]

    def attach(self) -> List[Any]:
        return [m.register_forward_hook(self._forward_hook(n)) for n, m in self.leaves.items()]

    def _forward_hook(self, name: str) -> Callable:
        def hook(module, args, output):
            outs = list(_tensors(output))
            bad = [self.acts[name].add(t, self.scratch) for t in outs]
            for t in outs:
                if t.requires_grad:
                    t.register_hook(self._grad_hook(name))
            if outs:
                self._count_produced(name, list(_tensors(args)), bad)
            if self.fp8_on and name in self.fp8 and args and isinstance(args[0], torch.Tensor):
                self.fp8[name].forward(args[0], module, output)
        return hook

    def _grad_hook(self, name: str) -> Callable:
        def hook(grad):
            self.out_grads[name].add(grad, self.scratch)
            if self.fp8_on and name in self.fp8:
                self.fp8[name].grad(grad.detach().float())
        return hook

    def _count_produced(self, name, inputs, bad_counts) -> None:
        bad = sum(bad_counts)
        for t in inputs:  # counted only when every input was finite (on the device: no sync)
            bad = bad * all_finite(t).to(bad.device)
        self.produced[name] = bad if name not in self.produced else self.produced[name] + bad

    def record_grads(self) -> bool:
        """Count every parameter's gradient; whether all of them are finite."""
        bad = []
        for name, p in self.model.named_parameters():
            if p.grad is not None:
                g = p.grad.coalesce().values() if p.grad.is_sparse else p.grad
                bad.append(self.grads[name].add(g, self.scratch))
        return not bool(torch.stack(bad).any()) if bad else True

    def record_updates(self, before: Dict[str, torch.Tensor]) -> None:
        """Count, per parameter, the update elements a bf16 / fp16 weight would not register."""
        for name, p in self.model.named_parameters():
            if name in before:
                w, u = before[name], p.detach().float() - before[name]
                moved = (u != 0) & torch.isfinite(u)
                row = [moved.sum()] + [(moved & ((w.to(dt).float() + u).to(dt) == w.to(dt))).sum()
                                       for dt in (torch.bfloat16, torch.float16)]
                self.lost[name] = torch.stack(row)

    def result(self, losses, applied, optimizer: str) -> Measurements:
        def stats(accs):
            return {n: a.stats() for n, a in accs.items() if a.counts is not None}

        lost = {}
        for name, (moved, bf16, fp16) in ((n, r.tolist()) for n, r in self.lost.items()):
            lost[name] = {"bfloat16": bf16 / max(moved, 1), "float16": fp16 / max(moved, 1)}
        fp8 = {n: r for n, r in ((n, a.result()) for n, a in self.fp8.items()) if r is not None}
        return Measurements(
            modules={n: type(m).__name__ for n, m in self.leaves.items()},
            params={n: _owner(n) for n, _ in self.model.named_parameters()},
            activations=stats(self.acts), output_grads=stats(self.out_grads), grads=stats(self.grads),
            produced={n: int(v) for n, v in self.produced.items()}, lost=lost, fp8=fp8,
            losses=losses, applied=applied, optimizer=optimizer,
        )


def check_loss(loss) -> torch.Tensor:
    """``loss`` if it is a scalar floating tensor that requires grad, else a clear error."""
    if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.is_floating_point()):
        got = f"a tensor of shape {tuple(loss.shape)} and dtype {loss.dtype}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise TypeError(f"precision_report(loss_fn=...): loss_fn(model, batch) must return a scalar floating tensor, got {got}.")
    if not loss.requires_grad:
        raise ValueError("precision_report(loss_fn=...): the loss does not require grad; compute it from the model's output.")
    return loss


def _copies(model: nn.Module, optimizer) -> Tuple[nn.Module, torch.optim.Optimizer, str]:
    """A deep copy of the model and one of the optimizer stepping it (SGD when none is given)."""
    if optimizer is None:
        twin = copy.deepcopy(model)
        return twin, torch.optim.SGD(twin.parameters(), lr=DEFAULT_LR), f"SGD(lr={DEFAULT_LR:g}) (no optimizer given)"
    twin, opt = copy.deepcopy((model, optimizer))
    return twin, opt, type(optimizer).__name__


def _step(model, optimizer, loss_fn, batch, rec: Recorder, updates: bool) -> Tuple[float, bool]:
    """One fp32 training step with the hooks on; applied only if the gradients are finite.
    ``updates``: also count the update elements a half weight would lose."""
    optimizer.zero_grad(set_to_none=True)
    loss = check_loss(loss_fn(model, batch))
    loss.backward()
    applied = rec.record_grads() and bool(torch.isfinite(loss.detach()))
    if applied:
        before = {n: p.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None and updates}
        optimizer.step()
        rec.record_updates(before)
    return loss.item(), applied


def measure(model: nn.Module, loss_fn: Callable, batches: List[Any], optimizer, fp8_names: Sequence[str]) -> Measurements:
    """Train a copy of ``model`` (and of ``optimizer``) one fp32 step per batch, counting as it goes.

    The model, the optimizer and the random number generators are left as they were.
    """
    cuda = sorted({t.device.index or 0 for t in itertools.chain(model.parameters(), model.buffers()) if t.is_cuda})
    with torch.random.fork_rng(devices=cuda), torch.enable_grad():
        twin, opt, described = _copies(model, optimizer)
        twin.train()
        rec = Recorder(twin, fp8_names)
        handles = rec.attach()
        try:
            steps: List[Tuple[float, bool]] = []
            for batch in batches:  # updates of the first applied step only
                steps.append(_step(twin, opt, loss_fn, batch, rec, updates=not any(ok for _, ok in steps)))
                rec.fp8_on = False
        finally:
            for h in handles:
                h.remove()
    return rec.result([s[0] for s in steps], [s[1] for s in steps], described)
