"""What the precision report measures: up to two fp32 training steps on a copy, with hooks.

Every tensor a hook sees is reduced at once to a :class:`Stats`: its element count, its
non-finite and zero counts, its largest magnitude, and how many of its magnitudes lie below
each value of :data:`EDGES` -- the magnitudes at which a value, multiplied by a loss scale
``2**k``, overflows float16 or rounds to zero there (and the same for bfloat16 unscaled).
From those counts the share of elements that overflow or flush is exact for any of these
scales, so one pass serves every opt level. Nothing else of a tensor is kept.

Linear layers that O6 would convert are also run once through an emulated fp8 matmul
(``torch.float8_e4m3fn`` input and weight, one scale per tensor: amax maps to 448, as a
dynamic tensorwise recipe does) on the input the layer was called with.
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


def _next_up(value: float) -> float:
    """The next float32 above ``value`` (so ``|x| < edge`` means ``|x| <= value`` in float32)."""
    t = torch.tensor(value, dtype=torch.float32)
    return torch.nextafter(t, torch.tensor(math.inf)).item()


def _edges() -> Tuple[Tuple[float, ...], Dict[Tuple[str, str, int], int]]:
    """Sorted thresholds, and (dtype, "overflow"/"flush", scale exponent) -> index among them."""
    named = {("bfloat16", "overflow", 0): BF16_OVERFLOW, ("bfloat16", "flush", 0): _next_up(BF16_FLUSH)}
    for e in SCALE_EXPONENTS:
        named[("float16", "overflow", e)] = FP16_OVERFLOW * 2.0 ** -e
        named[("float16", "flush", e)] = _next_up(FP16_FLUSH * 2.0 ** -e)
    edges = sorted(set(named.values()))
    return tuple(edges), {key: edges.index(v) for key, v in named.items()}


EDGES, EDGE_INDEX = _edges()


@dataclasses.dataclass
class Stats:
    """Element counts of the tensors one hook saw (summed over calls and steps).

    ``below[i]``: finite elements with magnitude below ``EDGES[i]``.
    """

    numel: int
    nonfinite: int
    zeros: int
    amax: float
    below: List[int]

    def _index(self, dtype: str, what: str, scale: float) -> int:
        e = math.log2(scale)
        if (dtype, what, e) not in EDGE_INDEX:
            raise ValueError(f"scale={scale!r}: expected a power of two from 2**-24 to 2**16 (1 for bfloat16).")
        return EDGE_INDEX[(dtype, what, int(e))]

    def overflow(self, dtype: str, scale: float = 1.0) -> float:
        """Share of elements that overflow ``dtype`` ("float16"/"bfloat16") once multiplied by ``scale``."""
        finite = self.numel - self.nonfinite
        return (finite - self.below[self._index(dtype, "overflow", scale)]) / max(self.numel, 1)

    def flush(self, dtype: str, scale: float = 1.0) -> float:
        """Share of elements, nonzero in fp32, that round to zero in ``dtype`` once multiplied by ``scale``."""
        return (self.below[self._index(dtype, "flush", scale)] - self.zeros) / max(self.numel, 1)


class _Acc:
    """Running counts of one name, kept on the tensors' device until :meth:`stats`."""

    def __init__(self):
        self.counts: Optional[torch.Tensor] = None
        self.amax: Optional[torch.Tensor] = None

    def add(self, t: torch.Tensor, edges: torch.Tensor) -> None:
        a = t.detach().float().abs().flatten()
        finite = torch.isfinite(a)
        a = torch.where(finite, a, torch.zeros((), device=a.device))
        nonfinite = a.numel() - finite.sum()
        head = torch.stack([torch.tensor(a.numel(), device=a.device), nonfinite, (a == 0).sum() - nonfinite])
        below = torch.bucketize(a, edges, right=True).bincount(minlength=len(edges) + 1).cumsum(0)[:-1]
        counts = torch.cat([head, below])
        amax = a.max() if a.numel() else torch.zeros((), device=a.device)
        self.counts = counts if self.counts is None else self.counts + counts
        self.amax = amax if self.amax is None else torch.maximum(self.amax, amax)

    def stats(self) -> Stats:
        numel, nonfinite, zeros, *below = self.counts.tolist()  # below counts the non-finite as zeros
        return Stats(numel, nonfinite, zeros, self.amax.item(), [b - nonfinite for b in below])


@dataclasses.dataclass
class Fp8:
    """Emulated fp8 of one Linear: matmul error against fp32 and the share of elements fp8 flushes."""

    matmul_error: float
    input_flush: float
    weight_flush: float
    grad_flush: Optional[float]


def fp8_qdq(t: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn) -> torch.Tensor:
    """``t`` through ``dtype`` with one scale for the tensor (its amax maps to the format's max), back in fp32."""
    t = t.detach().float()
    fmax = torch.finfo(dtype).max
    scale = fmax / t.abs().amax().clamp(min=1e-12)
    return (t * scale).clamp(-fmax, fmax).to(dtype).float() / scale


class _Fp8Acc:
    """Squared error norms and flush counts of one Linear's emulated fp8 matmuls."""

    def __init__(self):
        self.sums: Dict[str, torch.Tensor] = {}

    def _add(self, key, value):
        self.sums[key] = value if key not in self.sums else self.sums[key] + value

    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> None:
        x = x.detach().float().reshape(-1, x.shape[-1])
        if not (torch.isfinite(x).all() and torch.isfinite(weight).all()):
            return
        xq, wq = fp8_qdq(x), fp8_qdq(weight)
        ref = F.linear(x, weight.detach().float())
        self._add("err2", (F.linear(xq, wq) - ref).square().sum())
        self._add("ref2", ref.square().sum())
        for key, t, q in (("x", x, xq), ("w", weight.detach(), wq)):
            self._add(key + "_flush", ((q == 0) & (t != 0)).sum())
            self._add(key + "_n", torch.tensor(t.numel(), device=t.device))

    def grad(self, g: torch.Tensor) -> None:
        if torch.isfinite(g).all():
            q = fp8_qdq(g, torch.float8_e5m2)
            self._add("g_flush", ((q == 0) & (g != 0)).sum())
            self._add("g_n", torch.tensor(g.numel(), device=g.device))

    def result(self) -> Optional[Fp8]:
        if "err2" not in self.sums:
            return None
        s = {k: v.item() for k, v in self.sums.items()}
        grad = s["g_flush"] / s["g_n"] if "g_n" in s else None
        return Fp8(math.sqrt(s["err2"] / max(s["ref2"], 1e-300)), s["x_flush"] / s["x_n"], s["w_flush"] / s["w_n"], grad)


@dataclasses.dataclass
class Measurements:
    """What :func:`measure` saw, by name as ``named_modules()`` / ``named_parameters()`` give them.

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
        self.lost: Dict[str, torch.Tensor] = {}  # parameter -> [moved, lost bf16, lost fp16]
        self._edges: Dict[torch.device, torch.Tensor] = {}

    def edges(self, device: torch.device) -> torch.Tensor:
        if device not in self._edges:
            self._edges[device] = torch.tensor(EDGES, dtype=torch.float32, device=device)
        return self._edges[device]

    def attach(self) -> List[Any]:
        return [m.register_forward_hook(self._forward_hook(n)) for n, m in self.leaves.items()]

    def _forward_hook(self, name: str) -> Callable:
        def hook(module, args, output):
            outs = list(_tensors(output))
            for t in outs:
                self.acts[name].add(t, self.edges(t.device))
                if t.requires_grad:
                    t.register_hook(self._grad_hook(name))
            if outs:
                self._count_produced(name, list(_tensors(args)), outs)
            if name in self.fp8 and args and isinstance(args[0], torch.Tensor):
                self.fp8[name].forward(args[0], module.weight)
        return hook

    def _grad_hook(self, name: str) -> Callable:
        def hook(grad):
            self.out_grads[name].add(grad, self.edges(grad.device))
            if name in self.fp8:
                self.fp8[name].grad(grad.detach().float())
        return hook

    def _count_produced(self, name, inputs, outs) -> None:
        bad = sum((~torch.isfinite(t.detach())).sum() for t in outs)
        for t in inputs:  # counted only when every input was finite (on the device: no sync)
            bad = bad * torch.isfinite(t.detach()).all().to(bad.device)
        self.produced[name] = bad if name not in self.produced else self.produced[name] + bad

    def record_grads(self) -> bool:
        """Count every parameter's gradient; whether all of them are finite."""
        finite = []
        for name, p in self.model.named_parameters():
            if p.grad is not None:
                g = p.grad.coalesce().values() if p.grad.is_sparse else p.grad
                self.grads[name].add(g, self.edges(g.device))
                finite.append(torch.isfinite(g).all())
        return bool(torch.stack(finite).all()) if finite else True

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
        finally:
            for h in handles:
                h.remove()
    return rec.result([s[0] for s in steps], [s[1] for s in steps], described)
