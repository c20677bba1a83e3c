"""Shared pieces of the reliability suite: tiny models, fault injection, bit-exact snapshots,
and a reference model of the loss scaler's rules written from the spec (not from ampkit).
"""
import math
from typing import Dict, Optional, Tuple

import torch
from torch import nn

import ampkit
from ampkit._run.registry import current as current_run, of_optimizer

LEVELS = ["O0", "O1", "O2", "O3", "O4", "O5"]
DYNAMIC_LEVELS = {"O1", "O2"}  # the levels whose default loss scale is "dynamic"
CAST_LEVELS = {"O0": torch.float32, "O2": torch.float16, "O3": torch.float16, "O5": torch.bfloat16}
FLT_TINY = torch.finfo(torch.float32).tiny
FLT_MAX = torch.finfo(torch.float32).max


# --- models and optimizers ------------------------------------------------------------

class Tiny(nn.Module):
    """4 -> 6 -> 3; tanh rather than relu so no gradient is ever exactly zero."""

    def __init__(self, din=4, dh=6, dout=3):
        super().__init__()
        self.fc1 = nn.Linear(din, dh)
        self.fc2 = nn.Linear(dh, dout)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def make_optimizer(name: str, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    if name == "adamw":
        # eps=1e-3 is representable in float16: at O3 (pure fp16, no masters) AdamW's
        # default eps=1e-8 rounds to 0 and 0/0 puts NaN into the weights on its own.
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01, eps=1e-3)
    raise ValueError(name)


def make(opt_name="sgd", seed=0, model_cls=Tiny):
    torch.manual_seed(seed)
    model = model_cls()
    return model, make_optimizer(opt_name, model.parameters())


def fixed_batch(seed=1, n=16, din=4, dout=3):
    g = torch.Generator().manual_seed(seed)
    return 0.5 * torch.randn(n, din, generator=g), 0.5 * torch.randn(n, dout, generator=g)


LOSSES = (
    lambda out, y: nn.functional.mse_loss(out, y),
    lambda out, y: 0.1 * out.pow(2).mean(),
    lambda out, y: (out - y).abs().mean(),
)


def scalers(optimizer=None):
    """The loss scalers of ``optimizer``'s run, or of the current run (with several training runs
    alive, finding it runs the cycle collector: not once per step)."""
    run = current_run("reliability test") if optimizer is None else of_optimizer("reliability test", optimizer)
    return run.scalers


# --- fault injection --------------------------------------------------------------------

class Poison:
    """A tensor hook on one parameter: while ``kind`` is "inf"/"-inf"/"nan" the parameter's
    gradient gets that value in one element (the rest stays the true gradient)."""

    VALUES = {"inf": float("inf"), "-inf": float("-inf"), "nan": float("nan")}

    def __init__(self, param: torch.Tensor):
        self.kind: Optional[str] = None
        self.fired = 0
        self.handle = param.register_hook(self)

    def __call__(self, grad):
        if self.kind is None:
            return None
        self.fired += 1
        grad = grad.clone()
        grad.view(-1)[grad.numel() // 2] = self.VALUES[self.kind]
        return grad


def train(model, opt, x, y, steps, schedule: Dict[Tuple[int, int], str] = None, num_losses=1,
          poison: Poison = None, on_step=None):
    """Run ``steps`` steps; ``schedule[(step, loss_id)]`` poisons that loss's backward.

    ``on_step(step, poisoned, before, after)`` sees bit-exact snapshots around each
    ``optimizer.step()``. Returns the per-step list of every scaler's loss scale.
    """
    schedule = schedule or {}
    seq = []
    for step in range(steps):
        for k in range(num_losses):
            if poison is not None:
                poison.kind = schedule.get((step, k))
            loss = LOSSES[k](model(x), y)
            with ampkit.scale_loss(loss, opt, loss_id=k) as scaled:
                scaled.backward()
            if poison is not None:
                poison.kind = None
        poisoned = any((step, k) in schedule for k in range(num_losses))
        before = snapshot(model, opt) if on_step else None
        opt.step()
        if on_step:
            on_step(step, poisoned, before, snapshot(model, opt))
        opt.zero_grad()
        seq.append(tuple(s.loss_scale() for s in scalers(opt)))
    return seq


def eval_loss(model, x, y) -> float:
    with torch.no_grad():
        return nn.functional.mse_loss(model(x).float(), y).item()


# --- bit-exact snapshots ----------------------------------------------------------------

def raw(t: torch.Tensor):
    """A tensor's dtype, shape, device and exact bits (NaN payloads and -0.0 included)."""
    t = t.detach()
    if t.device.type == "meta":
        return (t.dtype, tuple(t.shape), "meta", None)
    bits = t.cpu().reshape(-1).clone()
    if bits.dtype != torch.bool:
        bits = bits.view(torch.uint8)
    return (t.dtype, tuple(t.shape), t.device.type, bits)


def _same_raw(a, b) -> bool:
    if a[:3] != b[:3]:
        return False
    return (a[3] is None and b[3] is None) or torch.equal(a[3], b[3])


def _value(v):
    return raw(v) if torch.is_tensor(v) else ("py", repr(v))


def snapshot(model: nn.Module, opt=None, grads=False) -> dict:
    """Everything a step or a refused call could change, as exact bits and identities."""
    snap = {
        "model.class": type(model),
        "model.attrs": sorted(k for k in vars(model) if k.startswith("_ampkit")),
        "model.hooks": [(len(m._forward_hooks), len(m._forward_pre_hooks), len(m._state_dict_hooks),
                         len(m._load_state_dict_pre_hooks)) for m in model.modules()],
        "model.params": [(n, raw(p), p.requires_grad, id(p)) for n, p in model.named_parameters()],
        "model.buffers": [(n, raw(b)) for n, b in model.named_buffers()],
    }
    if grads:
        snap["model.grads"] = [(n, None if p.grad is None else raw(p.grad)) for n, p in model.named_parameters()]
    if opt is not None:
        params = [p for g in opt.param_groups for p in g["params"]]
        index = {id(p): i for i, p in enumerate(params)}
        snap["opt.class"] = type(opt)
        snap["opt.attrs"] = sorted(k for k in vars(opt) if k.startswith("_ampkit") or k in ("step", "zero_grad", "add_param_group"))
        snap["opt.methods"] = [id(vars(opt).get(k)) for k in ("step", "zero_grad", "add_param_group")]
        snap["opt.groups"] = [
            ([id(p) for p in g["params"]], sorted((k, repr(v)) for k, v in g.items() if k != "params"))
            for g in opt.param_groups
        ]
        snap["opt.params"] = [raw(p) for p in params]  # the masters where they exist
        snap["opt.state"] = sorted(
            (index.get(id(p), -1), sorted((k, _value(v)) for k, v in st.items()))
            for p, st in opt.state.items()
        )
        if grads:
            snap["opt.grads"] = [None if p.grad is None else raw(p.grad) for p in params]
    return snap


def diff(a: dict, b: dict) -> list:
    """Names of the snapshot entries that differ (empty: bit-identical)."""
    out = []
    for key in a.keys() | b.keys():
        if key not in a or key not in b:
            out.append(key)
            continue
        if not _deep_same(a[key], b[key]):
            out.append(key)
    return sorted(out)


def _deep_same(x, y) -> bool:
    if isinstance(x, tuple) and len(x) == 4 and isinstance(x[0], torch.dtype):
        return isinstance(y, tuple) and len(y) == 4 and _same_raw(x, y)
    if isinstance(x, (list, tuple)):
        return type(x) is type(y) and len(x) == len(y) and all(_deep_same(i, j) for i, j in zip(x, y))
    if torch.is_tensor(x):
        return torch.is_tensor(y) and _same_raw(raw(x), raw(y))
    return x == y


def assert_unchanged(before: dict, after: dict, what="state"):
    changed = diff(before, after)
    assert not changed, f"{what} changed: {changed}"


def all_finite(model, opt=None) -> bool:
    tensors = list(model.parameters()) + ([p for g in opt.param_groups for p in g["params"]] if opt else [])
    return all(bool(torch.isfinite(t).all()) for t in tensors)


# --- the scaler's rules, from the spec ---------------------------------------------------

class ReferenceScaler:
    """The rules of issue 2 (+ hysteresis, issue 7), written independently of ampkit.

    dynamic: start at clamp(init); an overflow skips the step and resets the clean count;
    the H-th overflow in a row (and every one after it, until a clean step) multiplies the
    scale by ``backoff``; ``interval`` clean steps in a row multiply it by ``growth``.
    Every new scale is clamped to [min, max] and kept a positive, finite float32.
    static: the scale never moves, but every overflowing step is still skipped.
    """

    def __init__(self, loss_scale="dynamic", init=2.0**16, growth=2.0, backoff=0.5, interval=2000,
                 min_scale=None, max_scale=2.0**24, hysteresis=1):
        self.dynamic = loss_scale == "dynamic"
        self.growth, self.backoff, self.interval = growth, backoff, interval
        self.min_scale, self.max_scale, self.hysteresis = min_scale, max_scale, hysteresis
        self.scale = self.clamp(init) if self.dynamic else float(loss_scale)
        self.clean = self.streak = self.skipped = 0

    def clamp(self, s):
        s = min(s, self.max_scale)
        if self.min_scale is not None:
            s = max(s, self.min_scale)
        return min(max(s, FLT_TINY), FLT_MAX)

    def step(self, overflow: bool) -> bool:
        if overflow:
            self.skipped += 1
            self.clean = 0
            self.streak += 1
            if self.dynamic and self.streak >= self.hysteresis:
                self.scale = self.clamp(self.scale * self.backoff)
            return True
        self.streak = 0
        self.clean += 1
        if self.dynamic and self.clean == self.interval:
            self.scale = self.clamp(self.scale * self.growth)
            self.clean = 0
        return False


def expected_scales(schedule, steps, num_losses, **ref_kwargs):
    refs = [ReferenceScaler(**ref_kwargs) for _ in range(num_losses)]
    seq = []
    for step in range(steps):
        for k, r in enumerate(refs):
            r.step((step, k) in schedule)
        seq.append(tuple(r.scale for r in refs))
    return seq, refs


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)
