"""Optimizer state in 8 bits between steps (``optimizer_state_dtype="8bit"``, O8).

Each elementwise state tensor of a half parameter (floating, the parameter's shape, not
``step``) lives between steps as two entries of ``optimizer.state[p]`` in place of its own
key ``k``: ``k + CODES``, one byte per element in the parameter's shape, and ``k + SCALES``,
a float32 power of two per block of :data:`BLOCK` flat elements (``core/blockquant.py``).
Signed state (``exp_avg``, ``momentum_buffer``, any key not listed) is int8 linear; the
non-negative keys of :data:`SQRT_KEYS` (second moments) are uint8 e4m4 codes of their square
root, squared again when widened. Codes are rounded stochastically with the run's rounding
generator of their device, so the draws checkpoint with it.

A consumer of ``optimizer.state`` finds no ``exp_avg`` between steps (a KeyError, not int8
bytes read as numbers); ``optimizer.state_dict()`` holds every such entry widened back to
float32 under its own key, the format of O7 and plain torch, so a checkpoint loads anywhere.
Loading quantizes again without random draws that matter: a widened value is on the grid
and comes back exactly (for second moments whenever the square root is above 2**-63).
"""
from typing import Callable, Dict, List, Tuple

import torch

from ..core.blockquant import dequantize, num_blocks, quantize_

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
        st = opt_state.get(p)
        for k in [] if st is None else [k[:-len(CODES)] for k in st if isinstance(k, str) and k.endswith(CODES)]:
            out.append((st, k, st[k + CODES], st[k + SCALES]))
    return out


def widen_into(entries: List[Held], slots: List[torch.Tensor]) -> None:
    """Put each entry back under its key as float32, written into its slot (for the step)."""
    with torch.no_grad():
        for (st, k, codes, scales), slot in zip(entries, slots):
            _widen(k, codes, scales, slot)
            st[k] = slot
            del st[k + CODES], st[k + SCALES]


def pack(states, generator: Callable[[torch.device], torch.Generator], reuse: Dict[tuple, tuple]) -> None:
    """Store every packable entry of ``states`` (``[(state, param)]``) as codes and scales,
    rounded with ``generator(device)``; into the codes and scales ``reuse[(id(state), key)]``
    where the entry had some."""
    with torch.no_grad():
        for st, p in states:
            for k, v in [(k, v) for k, v in st.items() if packable(k, v, p)]:
                codes, scales = reuse.get((id(st), k)) or _empty(k, v)
                x = v.detach().float().reshape(-1)
                if k in SQRT_KEYS:
                    x = x.sqrt()
                quantize_(codes.view(-1), scales, x, generator(v.device), BLOCK)
                del st[k]
                st[k + CODES], st[k + SCALES] = codes, scales


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
            k = c[:-len(CODES)]
            wide[k] = _widen(k, st[c], st[k + SCALES], torch.empty(st[c].shape, dtype=torch.float32, device=st[c].device))
        state[i] = wide
    return {**state_dict, "state": state}


def _widen(key: str, codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    dequantize(codes.view(-1), scales, out.view(-1), BLOCK)
    return out.square_() if key in SQRT_KEYS else out


def _empty(key: str, like: torch.Tensor):
    return (torch.empty(like.shape, dtype=code_dtype(key), device=like.device),
            torch.empty(num_blocks(like.numel(), BLOCK), dtype=torch.float32, device=like.device))
