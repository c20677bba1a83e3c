"""Optimizer state in 8 bits between steps (``optimizer_state_dtype="8bit"``, O8).

Each elementwise state tensor of a half parameter (floating, the parameter's shape, not
``step``) lives between steps as two entries of ``optimizer.state[p]`` in place of its own
key ``k``: ``k + CODES``, one byte per element in the parameter's shape, and ``k + SCALES``,
a float32 power of two per block of :data:`BLOCK` flat elements (``core/blockquant.py``).
Signed state (``exp_avg``, ``momentum_buffer``, any key not listed) is int8 linear; the
non-negative keys of :data:`SQRT_KEYS` (second moments) are uint8 e4m4 codes of their square
root, squared again when widened. Codes are rounded stochastically with the run's rounding
generator of their device, so the draws checkpoint with it. A step widens and packs each
device's entries of one code in one call, their tensors laid out back to back from block
boundaries: the blocks, and so the scales, stay per tensor whatever the chunking.

A consumer of ``optimizer.state`` finds no ``exp_avg`` between steps (a KeyError, not int8
bytes read as numbers); ``optimizer.state_dict()`` holds every such entry widened back to
float32 under its own key, the format of O7 and plain torch, so a checkpoint loads anywhere.
Loading quantizes again with a scratch generator, not the run's: a widened value is on the
grid and comes back exactly, whatever the draws (second moments whenever their square root
lies between 2**-63 and 2**64, where squaring it is exact).
"""
from typing import Callable, Dict, List, Tuple

import torch

from ..core.blockquant import dequantize, num_blocks, quantize_
from .shards import like, local

BLOCK = 256
CODES, SCALES = ".codes", ".scales"
SQRT_KEYS = frozenset({  # non-negative state, stored as the square root (a negative value reads back NaN)
    "exp_avg_sq", "max_exp_avg_sq",  # Adam, AdamW, NAdam, RAdam
    "sum",  # Adagrad
    "square_avg", "acc_delta",  # RMSprop, Adadelta
    "exp_inf",  # Adamax
    "step_size",  # Rprop
})

Held = Tuple[dict, str, torch.Tensor, torch.Tensor]  # (a parameter's state, key, codes, scales)


def code_dtype(key: str) -> torch.dtype:
    """uint8 (of the square root) for the keys of :data:`SQRT_KEYS`, int8 for any other."""
    return torch.uint8 if key in SQRT_KEYS else torch.int8


def packable(key, value, p: torch.Tensor) -> bool:
    """Whether ``state[key] = value`` of parameter ``p`` is kept in 8 bits between steps."""
    return (isinstance(key, str) and key != "step" and not key.endswith((CODES, SCALES)) and torch.is_tensor(value)
            and value.is_floating_point() and value.shape == p.shape)


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
    and code, into one buffer laid out as :func:`_layout` says."""
    with torch.no_grad():
        for group in _groups(entries, lambda e: e[2]).values():
            codes, scales = [local(e[2]) for e in group], [e[3] for e in group]  # FSDP2: the shards
            q, segments = _layout(codes, codes[0].dtype)
            torch._foreach_copy_(segments, codes)
            out = _widen(q, torch.cat(scales), torch.empty(q.numel(), device=q.device))
            for (st, k, c, _), slot in zip(group, _segments(out, codes)):
                st[k] = like(slot, c)
                del st[k + CODES], st[k + SCALES]


def pack(states, generator: Callable[[torch.device], torch.Generator], reuse: Dict[tuple, tuple]) -> None:
    """Store every packable entry of ``states`` (``[(state, param)]``) as codes and scales,
    rounded with ``generator(device)``, one quantize per device and code; into the codes and
    scales ``reuse[(id(state), key)]`` where the entry had some."""
    entries = [(st, k, v) for st, p in states for k, v in st.items() if packable(k, v, p)]
    with torch.no_grad():
        for group in _groups(entries, lambda e: e[2], lambda e: code_dtype(e[1])).values():
            values = [local(v.detach()) for _, _, v in group]
            code = code_dtype(group[0][1])
            x, segments = _layout(values, torch.float32, fill=0.0)  # zeros: no block's scale changes
            torch._foreach_copy_(segments, values)
            if code == torch.uint8:
                x.sqrt_()
            q = torch.empty(x.numel(), dtype=code, device=x.device)
            scales = torch.empty(x.numel() // BLOCK, device=x.device)
            quantize_(q, scales, x, generator(x.device), BLOCK)
            made = [(local(c), s) for c, s in (reuse.get((id(st), k)) or _empty(k, x) for (st, k, _), x in zip(group, values))]
            torch._foreach_copy_([c for c, _ in made], _segments(q, values))
            torch._foreach_copy_([s for _, s in made], list(scales.split([s.numel() for _, s in made])))
            for (st, k, v), (c, s) in zip(group, made):
                del st[k]
                st[k + CODES], st[k + SCALES] = like(c, v), s  # codes sharded like the state (FSDP2), scales the shard's


def _groups(entries, tensor_of, code_of=None) -> dict:
    """``entries`` by (device, code dtype), in order."""
    out = {}
    for e in entries:
        t = tensor_of(e)
        out.setdefault((t.device, code_of(e) if code_of else t.dtype), []).append(e)
    return out


def _layout(tensors, dtype, fill=None):
    """One flat buffer holding ``tensors`` back to back, each from a block boundary (the
    blocks stay per tensor), and each tensor's segment in it (in its shape)."""
    total = sum(num_blocks(t.numel(), BLOCK) for t in tensors) * BLOCK
    device = tensors[0].device
    flat = torch.empty(total, dtype=dtype, device=device) if fill is None else torch.full((total,), fill, dtype=dtype, device=device)
    return flat, _segments(flat, tensors)


def _segments(flat, tensors) -> List[torch.Tensor]:
    sizes = [n for t in tensors for n in (t.numel(), -t.numel() % BLOCK)]  # each tensor, then its padding
    return [part.view(t.shape) for part, t in zip(flat.split(sizes)[::2], tensors)]


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
            wide[k] = like(_widen(q, st[k + SCALES], out), st[c])
        state[i] = wide
    return {**state_dict, "state": state}


def _widen(codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``codes`` and their scales as float32 values in ``out``: squared where the codes are
    uint8 (the square roots of :data:`SQRT_KEYS`)."""
    dequantize(codes.view(-1), scales, out.view(-1), BLOCK)
    return out.square_() if codes.dtype == torch.uint8 else out


def _empty(key: str, like: torch.Tensor):
    return (torch.empty(like.shape, dtype=code_dtype(key), device=like.device),
            torch.empty(num_blocks(like.numel(), BLOCK), dtype=torch.float32, device=like.device))
