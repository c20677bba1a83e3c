"""Optimizer state in 8 bits between steps (``optimizer_state_dtype="8bit"``, O8).

Each elementwise moment ``k`` of a half parameter lives as ``k + CODES`` (int8, or uint8 e4m4
of the square root for `SQRT_KEYS`) and ``k + SCALES`` (a float32 power of two per block of
`BLOCK` elements of the full parameter), rounded stochastically with the counter bits; the
first moments of `BOUNDED` optimizers are capped against their second. ``state_dict()`` holds
it widened to float32. Design notes (layout, blocks across shards, the caps, checkpoints):
docs/design/update-engine.md.
"""
import functools
import math
from typing import Dict, List, Optional, Tuple

import torch

from .._kernels import ieee
from .._kernels.blockquant import block_absmax, counter_draws, dequantize, num_blocks, quantize_
from .._kernels.fused_adamw_8bit import BLOCK
from .shards import global_index, like, local
from .shared_blocks import block_first, share_block_maxima_, split_blocks

CODES, SCALES = ".codes", ".scales"
SQRT_KEYS = frozenset({  # non-negative state, stored as the square root (a negative value reads back NaN)
    "exp_avg_sq", "max_exp_avg_sq",  # Adam, AdamW, NAdam, RAdam
    "sum",  # Adagrad
    "square_avg", "acc_delta",  # RMSprop, Adadelta
    "exp_inf",  # Adamax
    "step_size",  # Rprop
    "variance",  # Adafactor (parameters of one dimension)
})
MOMENT_KEYS = SQRT_KEYS | {"exp_avg", "momentum_buffer", "grad_avg", "ax", "prev"}  # torch's elementwise state
SCALAR_KEYS = frozenset({"step", "mu_product", "eta", "mu"})  # per-step scalars (NAdam, ASGD): kept exact


def _ema_bound(b1: float, b2: float, t: float) -> float:
    """The largest ``|m_t| / sqrt(v_t)`` of ``m = b1 m + (1-b1) g``, ``v = b2 v + (1-b2) g**2``
    from zero after ``t`` steps: ``sqrt((1-b1)**2 / (1-b2) * sum_{j<t} (b1**2/b2)**j)``."""
    if b2 == 0 or b2 >= 1:
        return 1.0 if b1 == 0 and b2 == 0 else math.inf
    return math.sqrt((1 - b1) ** 2 / (1 - b2) * _geometric(b1 * b1 / b2, t))


def _max_bound(b1: float, b2: float, t: float) -> float:
    """Adamax: the largest ``|m_t| / u_t`` with ``u = max(b2 u, |g| + eps)``:
    ``(1-b1) sum_{j<t} (b1/b2)**j``."""
    if b2 == 0:
        return 1.0 if b1 == 0 else math.inf
    return (1 - b1) * _geometric(b1 / b2, t)


def _geometric(q: float, t: float) -> float:
    """``sum_{j<t} q**j`` (inf where it overflows)."""
    if q == 1:
        return t
    if t == math.inf:
        return 1 / (1 - q) if q < 1 else math.inf
    if q > 1 and t * math.log(q) > 700:
        return math.inf
    return (1 - q ** t) / (1 - q)


def _adam_like(group, t):
    """Adam's cap on ``|m_t| / sqrt(v_t)`` after step ``t``: the largest that keeps the next
    step's ``|m_hat| / sqrt(v_hat)`` within `_adam_constant` (``>= A_t``, so exact state is
    never capped); the per-step supremum ``A_t`` where that constant is infinite."""
    b1, b2 = map(float, group["betas"])
    top, gamma = _adam_constant(b1, b2), b1 * b1 / b2 if b2 else math.inf
    if not math.isfinite(top) or gamma == 0:
        return _ema_bound(b1, b2, t)
    nxt = top * (1 - b1 ** (t + 1)) / math.sqrt(1 - b2 ** (t + 1))
    return math.sqrt(max(nxt * nxt - (1 - b1) ** 2 / (1 - b2), 0.0) / gamma)


@functools.lru_cache(maxsize=64)
def _adam_constant(b1: float, b2: float) -> float:
    """The largest ``|m_hat_t| / sqrt(v_hat_t)`` of exact Adam at any step:
    ``sup_t A_t sqrt(1-b2**t) / (1-b1**t)`` (7.27 for betas (0.9, 0.999)); inf unless
    ``b1**2 < b2``. Past ``b1**t < 1e-12`` no step can exceed the limit ``A_inf`` by more."""
    if not 0 < b2 < 1 or b1 * b1 >= b2:
        return math.inf
    best, t = _ema_bound(b1, b2, math.inf), 0
    while b1 ** t >= 1e-12:
        t += 1
        best = max(best, _ema_bound(b1, b2, t) * math.sqrt(1 - b2 ** t) / (1 - b1 ** t))
    return best * (1 + 1e-12)


BOUNDED = (  # (optimizer classes, first moment, the state bounding it, bound(group, step), bounded by its square)
    ((torch.optim.Adam, torch.optim.AdamW, torch.optim.NAdam, torch.optim.RAdam), "exp_avg", "exp_avg_sq",
     _adam_like, False),
    ((torch.optim.Adamax,), "exp_avg", "exp_inf", lambda g, t: _max_bound(*map(float, g["betas"]), t), True),
    ((torch.optim.RMSprop,), "grad_avg", "square_avg", lambda g, t: _ema_bound(float(g["alpha"]), float(g["alpha"]), t),
     False),  # centered: |grad_avg| <= sqrt(1 - alpha**t) sqrt(square_avg), so the variance is never negative
)

Held = Tuple[dict, str, torch.Tensor, torch.Tensor]  # (a parameter's state, key, codes, scales)


def code_dtype(key: str) -> torch.dtype:
    """uint8 (of the square root) for the keys of `SQRT_KEYS`, int8 for any other."""
    return torch.uint8 if key in SQRT_KEYS else torch.int8


def packable(key, value, p: torch.Tensor) -> bool:
    """Whether ``state[key] = value`` of parameter ``p`` is kept in 8 bits between steps: a
    floating tensor of ``p``'s shape, under a moment's key (of a 0-dimensional ``p``: one of
    torch's `MOMENT_KEYS`, the only ones a per-step scalar cannot hide behind)."""
    return (isinstance(key, str) and key not in SCALAR_KEYS and not key.endswith((CODES, SCALES))
            and torch.is_tensor(value) and value.is_floating_point() and value.shape == p.shape
            and (p.dim() > 0 or key in MOMENT_KEYS))


def held(opt_state, params) -> List[Held]:
    """The packed entries of ``params``' states, in state order."""
    out = []
    for p in params:
        st = opt_state.get(p, {})
        keys = [c[:-len(CODES)] for c in st if isinstance(c, str) and c.endswith(CODES)]
        out += [(st, k, st[k + CODES], st[k + SCALES]) for k in keys]
    return out


def widen(entries: List[Held]) -> None:
    """Put each entry back under its key as float32 (for the step): one dequantize per device
    and code, into one buffer laid out as `_layout` says."""
    with torch.no_grad():
        for group in _groups(entries, lambda e: e[2]).values():
            codes, scales = [local(e[2]) for e in group], [e[3] for e in group]  # FSDP2: the shards
            firsts = [block_first(e[2]) for e in group]
            q, segments = _layout(codes, codes[0].dtype, firsts)
            torch._foreach_copy_(segments, codes)
            out = _widen(q, torch.cat(scales), torch.empty(q.numel(), device=q.device))
            for (st, k, c, _), slot in zip(group, _segments(out, codes, firsts)):
                st[k] = like(slot, c)
                del st[k + CODES], st[k + SCALES]


def pack(states, reuse: Dict[tuple, tuple], optimizer=None, rounder=None, ids: Optional[dict] = None) -> None:
    """Store every packable entry of ``states`` (``[(state, param)]``, each param as it sits in
    ``optimizer``'s param groups) as codes and scales, one quantize per device and code (second
    moments first: they cap the first moments of `BOUNDED` optimizers); into the codes
    and scales ``reuse[(id(state), key)]`` where the entry had some. Rounded stochastically
    with the counter bits of ``rounder`` (its ``seed`` and ``step``; ``ids[param]``, the
    parameter's index among the optimizer's), or to nearest when ``rounder`` is None (loaded
    state, on the grid already)."""
    entries = [(st, k, v) for st, p in states for k, v in st.items() if packable(k, v, p)]
    param_of = {id(st): p for st, p in states}
    where = _draw_sites(states, ids, paired_bits(optimizer)) if rounder is not None else {}
    caps, roots = _caps(states, optimizer), {}
    groups = _groups(entries, lambda e: e[2], lambda e: code_dtype(e[1]))
    with torch.no_grad():
        for (_, code), group in sorted(groups.items(), key=lambda item: item[0][1] != torch.uint8):
            values = [local(v.detach()) for _, _, v in group]
            params = [param_of[id(st)] for st, _, _ in group]
            firsts = [block_first(p) for p in params]
            x, segments = _layout(values, torch.float32, firsts, fill=0.0)  # zeros: no block's scale changes
            torch._foreach_copy_(segments, values)
            limit = None
            if code == torch.uint8:
                x.copy_(ieee.sqrt(x))  # correctly rounded (torch's is not), as O8's fused kernel
            else:
                limit = _limit(group, x, values, firsts, caps, roots)
            q = torch.empty(x.numel(), dtype=code, device=x.device)
            scales = torch.empty(x.numel() // BLOCK, device=x.device)
            sites = [where.get((id(st), k)) for st, k, _ in group]
            draws = None if rounder is None else _draws(rounder, sites, values, firsts, x)
            quantize_(q, scales, x, draws, BLOCK, limit, absmax=_shared_absmax(x, code, params, values, firsts))
            if code == torch.uint8 and caps:
                bounding = {cap[0] for cap in caps.values()}
                stored = _segments(dequantize(q, scales, x, BLOCK), values, firsts)
                roots.update({(id(st), k): r for (st, k, _), r in zip(group, stored) if (id(st), k) in bounding})
            made = [(local(c), s) for c, s in (reuse.get((id(st), k)) or _empty(k, x, f)
                                               for (st, k, _), x, f in zip(group, values, firsts))]
            torch._foreach_copy_([c for c, _ in made], _segments(q, values, firsts))
            torch._foreach_copy_([s for _, s in made], list(scales.split([s.numel() for _, s in made])))
            for (st, k, v), (c, s) in zip(group, made):
                del st[k]
                st[k + CODES], st[k + SCALES] = like(c, v), s  # codes sharded like the state (FSDP2), scales local


def paired_bits(optimizer) -> bool:
    """Whether O8 rounds with one counter word for two elements (`counter_bits.paired16`): where each
    parameter has at most one 8-bit state, an exact ``torch.optim.SGD`` (its momentum buffer); 16 bits
    for the weight, 16 for the state."""
    return type(optimizer) is torch.optim.SGD


def _draw_sites(states, ids: dict, paired: bool) -> Dict[tuple, tuple]:
    """``(id(state), key) -> (tensor, stream, index, paired)`` of each packable entry: its parameter's
    index among the optimizer's, ``1 +`` the key's place among the parameter's packable keys
    in sorted order (the same whatever order the state dict holds them in), where its
    elements sit in the full parameter (FSDP2: the shard's offset), and ``paired`` (`paired_bits`)."""
    out = {}
    for st, p in states:
        keys = sorted(k for k, v in st.items() if packable(k, v, p))
        first = global_index(p) if keys else 0
        out.update({(id(st), k): (ids[p], 1 + j, first, paired) for j, k in enumerate(keys)})
    return out


def _shared_absmax(x: torch.Tensor, code: torch.dtype, params, values, firsts) -> Optional[torch.Tensor]:
    """The block maxima of the group's buffer ``x`` with each block split between shards at
    its maximum over all of them (collective); None when no block is split (every rank
    agrees: the layout is the same on all)."""
    if not any(split_blocks(p, BLOCK) for p in params):
        return None
    absmax = block_absmax(x, code, BLOCK)
    at = [0]
    for v, f in zip(values, firsts):  # where each tensor's blocks start in the buffer's
        at.append(at[-1] + num_blocks(v.numel(), BLOCK, f))
    share_block_maxima_(absmax, list(zip(params, at)), BLOCK)
    return absmax


def _draws(rounder, sites: List[tuple], values: List[torch.Tensor], firsts, x: torch.Tensor) -> torch.Tensor:
    """The 24-bit draws of the group's flat buffer ``x`` (laid out as `_layout` says):
    each tensor's segment from its own counter bits, the padding 0 (its values are 0, on the grid)."""
    draws = torch.zeros(x.numel(), dtype=torch.int32, device=x.device)
    for segment, (tensor, stream, index, paired) in zip(_segments(draws, values, firsts), sites):
        counter_draws(segment.view(-1), rounder.seed, rounder.step, tensor, stream, index, paired)
    return draws


def _caps(states, optimizer) -> Dict[tuple, tuple]:
    """``(id(state), first moment) -> ((id(state), bounding key), bound, squared)`` for the
    `BOUNDED` pairs of ``states``, at each state's step count."""
    kinds = [b[1:] for b in BOUNDED if isinstance(optimizer, b[0])][:1]
    pairs = [(st, p, kinds[0]) for st, p in states if kinds and kinds[0][0] in st and kinds[0][1] in st]
    if not pairs:
        return {}
    group_of = {id(t): g for g in optimizer.param_groups for t in g["params"]}
    steps = _floats([st.get("step", 0.0) for st, _, _ in pairs])
    out = {}
    for (st, p, (first, second, bound, squared)), t in zip(pairs, steps):
        a = bound(group_of[id(p)], t) if id(p) in group_of else math.inf
        if math.isfinite(a):
            out[(id(st), first)] = ((id(st), second), a, squared)
    return out


def _limit(group, x: torch.Tensor, values, firsts, caps: dict, roots: dict):
    """The int8 group's cap on each stored magnitude (NaN: none): ``bound * sqrt(v)`` from the
    stored root of the bounding state (``bound * u`` for Adamax's ``exp_inf``). Where that
    is infinite, ``x`` (the first moments) is zeroed: exact Adam's update there is 0."""
    capped = [(i, caps[(id(st), k)]) for i, (st, k, _) in enumerate(group) if (id(st), k) in caps]
    capped = [(i, cap) for i, cap in capped if cap[0] in roots]
    if not capped:
        return None
    limit = torch.full_like(x, math.nan)
    segments = _segments(limit, values, firsts)
    dsts = [segments[i] for i, _ in capped]
    torch._foreach_copy_(dsts, [roots[cap[0]] for _, cap in capped])
    squares = [d for d, (_, cap) in zip(dsts, capped) if cap[2]]
    if squares:
        torch._foreach_mul_(squares, squares)
    torch._foreach_mul_(dsts, [cap[1] for _, cap in capped])
    if x.device.type != "cpu" or not math.isfinite(limit.nansum()):  # on the CPU: only when one is
        x.masked_fill_(limit.isinf(), 0.0)
    return limit


def _floats(values) -> List[float]:
    """Numbers and one-element tensors as floats: one transfer per device."""
    out, on = [v for v in values], {}
    for i, v in enumerate(values):
        if torch.is_tensor(v):
            on.setdefault(v.device, []).append(i)
    for idx in on.values():
        for i, f in zip(idx, torch.stack([local(values[i]).detach().reshape(()).float() for i in idx]).tolist()):
            out[i] = f
    return [float(v) for v in out]


def keep(opt_state, params) -> list:
    """What a skipped step puts back (`restore`), taken before `widen`: each of
    ``params``' state entries (its codes and scales as they are, its other tensors cloned:
    the optimizer changes ``step`` and the like in place), and a float32 parameter's values."""
    with torch.no_grad():
        return [(p, None if st is None else {k: _kept(k, v) for k, v in st.items()},
                 p.detach().clone() if p.dtype == torch.float32 else None)
                for p in params for st in (opt_state.get(p),)]


def restore(opt_state, kept: list, key_of) -> None:
    """Put back what `keep` took; each parameter's state is now under ``key_of(p)``."""
    with torch.no_grad():
        for p, entries, values in kept:
            if entries is None:
                opt_state.pop(key_of(p), None)
            else:
                st = opt_state[key_of(p)]
                st.clear()
                st.update(entries)
            if values is not None:
                p.copy_(values)


def _kept(key, value):
    packed = isinstance(key, str) and key.endswith((CODES, SCALES))
    return value.clone() if torch.is_tensor(value) and not packed else value


def _groups(entries, tensor_of, code_of=None) -> dict:
    """``entries`` by (device, code dtype), in order."""
    out = {}
    for e in entries:
        t = tensor_of(e)
        out.setdefault((t.device, code_of(e) if code_of else t.dtype), []).append(e)
    return out


def _layout(tensors, dtype, firsts, fill=None):
    """One flat buffer holding ``tensors`` back to back, each in blocks of its own: tensor
    ``i`` from its first element's place ``firsts[i] % BLOCK`` in its first block (its
    blocks are its full tensor's); and each tensor's segment in it (in its shape)."""
    total = sum(num_blocks(t.numel(), BLOCK, f) for t, f in zip(tensors, firsts)) * BLOCK
    device = tensors[0].device
    flat = torch.empty(total, dtype=dtype, device=device) if fill is None else torch.full((total,), fill, dtype=dtype, device=device)
    return flat, _segments(flat, tensors, firsts)


def _segments(flat, tensors, firsts) -> List[torch.Tensor]:
    sizes = []
    for t, f in zip(tensors, firsts):  # each tensor's lead, the tensor, its padding
        lead = f % BLOCK if t.numel() else 0
        sizes += [lead, t.numel(), -(lead + t.numel()) % BLOCK]
    return [part.view(t.shape) for part, t in zip(flat.split(sizes)[1::3], tensors)]


def widened_state_dict(optimizer, state_dict: dict) -> dict:
    """``optimizer.state_dict()`` post hook: packed entries as float32 under their own keys
    (new dicts; the optimizer's state is not touched)."""
    state = {}
    for i, st in state_dict["state"].items():
        codes = [k for k in st if isinstance(k, str) and k.endswith(CODES)]
        if not codes:
            state[i] = st
            continue
        wide = {k: v for k, v in st.items() if not (isinstance(k, str) and k.endswith((CODES, SCALES)))}
        for c in codes:
            k, q = c[:-len(CODES)], local(st[c])
            out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
            wide[k] = like(_widen(q, st[k + SCALES], out, block_first(st[c])), st[c])
        state[i] = wide
    return {**state_dict, "state": state}


def _widen(codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, first: int = 0) -> torch.Tensor:
    """``codes`` (element 0 at ``first``) and their scales as float32 values in ``out``:
    squared where the codes are uint8 (the square roots of `SQRT_KEYS`)."""
    dequantize(codes.view(-1), scales, out.view(-1), BLOCK, first % BLOCK)
    return out.square_() if codes.dtype == torch.uint8 else out


def _empty(key: str, like: torch.Tensor, first: int):
    return (torch.empty(like.shape, dtype=code_dtype(key), device=like.device),
            torch.empty(num_blocks(like.numel(), BLOCK, first), dtype=torch.float32, device=like.device))
