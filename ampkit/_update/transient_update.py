"""Half weights without fp32 masters: each step is computed in fp32 and rounded back.

At levels with ``update_rounding`` (O7) the optimizer holds the model's half parameters and
any ``torch.optim`` optimizer steps on them through `TransientUpdate`, chunk by
chunk: a chunk's half parameters and gradients get float32 copies (views of one buffer,
filled by one fused copy), which the optimizer steps on in their place (its
state is keyed by the copies for that call); the results are rounded back into the half
weights, stochastically (``"stochastic"``, with the counter bits of ``core/counter_bits.py``:
the same for any chunking or sharding) or to nearest. The
copies live for one chunk, so the extra memory is bounded by `CHUNK_ELEMENTS`
(a larger single tensor is its own chunk), and nothing fp32 persists but the optimizer
state. With ``optimizer_state_dtype=torch.bfloat16`` that state's elementwise tensors
(those of the parameter's shape) are stored in bfloat16 between steps too, rounded the
same way; with ``"8bit"`` (O8) they are stored as 8-bit codes with per-block scales
(``state_8bit.py``), widened to float32 for the chunk's step (a plain AdamW / Adam on CPU
steps its bf16 parameters in O8's one-pass kernel instead, ``fused_update_8bit.py``, in
the same chunks). Float32 parameters
(BatchNorm kept fp32) are stepped as they are. At O8 a chunk whose update would write a
non-finite weight writes nothing: its weights, float32 parameters and state stay, and the
step is reported skipped (``step_was_skipped``, a warning naming the parameters); with
several chunks, the other chunks' updates stand.

The optimizer must update each parameter from its own gradient and state (every
``torch.optim`` optimizer but LBFGS does): it is called once per chunk, seeing only that
chunk's gradients, without torch's step hooks (ampkit runs those once around the whole
step). Each chunk's call starts from the param groups' settings as the step found them, and
the settings a call changed (a custom optimizer's step counter in its groups) are kept once,
so the optimizer sees one step per training step at any model size.
"""
import logging
import types
from typing import Callable, List, Optional

import torch
from torch._utils import _unflatten_dense_tensors

from .._config.levels import HALF_DTYPES, STATE_8BIT
from .._kernels.remainder import combine, remainder, split_
from .._kernels.rounding import StochasticRounder
from .._run.overflow import all_ranks_max, parameter_names
from . import fused_update, fused_update_8bit, state_8bit
from .shards import global_index, like, local, shard_of

CHUNK_ELEMENTS = 2**22  # half parameters per chunk: 32 MiB of transient fp32 weights and gradients


def chunks(slots, limit: int) -> List[list]:
    """``slots`` (``(group, index, param)``) split into runs of at most ``limit`` half elements;
    float32 parameters join the first chunk, so each is stepped exactly once."""
    out, size = [[]], 0
    for slot in slots:
        p = slot[2]
        if p.dtype not in HALF_DTYPES:
            out[0].append(slot)
            continue
        if size and size + p.numel() > limit:
            out.append([])
            size = 0
        out[-1].append(slot)
        size += p.numel()
    return [c for c in out if c]


class TransientUpdate:
    """Replaces the optimizer's own ``step`` inside ampkit's wrapped ``step`` (after the
    overflow check, so a skipped step never reaches it: weights, optimizer state and the
    rounder's step counter stay untouched)."""

    def __init__(self, optimizer, step: Callable, rounding: str, rounder: Optional[StochasticRounder],
                 state_dtype: Optional[torch.dtype], model_states=None):
        self.optimizer = optimizer
        self.step = step
        self.rounding = rounding
        self.model_states = model_states  # with remainder masters: the models' remainders
        self.rounder = rounder
        self.state_dtype = state_dtype
        self.ids = {}  # parameter -> its index among the optimizer's (the counter bits' tensor)
        self.skipped_chunks = 0  # this step's chunks that wrote nothing (non-finite weights)
        self.scratch = {}  # O8's fused path: its backup buffers, kept from step to step

    def round_into(self, dsts: List[torch.Tensor], srcs: List[torch.Tensor], params: List[torch.Tensor],
                   streams: Optional[List[int]] = None) -> None:
        """``dsts[i] = srcs[i]`` (float32 into half, local shards), rounded stochastically with
        the counter bits of ``params[i]`` (the parameter ``dsts[i]`` is, or whose state it is)
        and ``streams[i]`` (0, the weight, by default), or to nearest; ``srcs`` may be
        overwritten."""
        if not dsts:
            return
        if self.rounding == "stochastic" and all(d.dtype == torch.bfloat16 for d in dsts):
            streams = streams or [0] * len(dsts)
            for stream in sorted(set(streams)):
                picked = [i for i, s in enumerate(streams) if s == stream]
                self.rounder.round_([dsts[i] for i in picked], [srcs[i] for i in picked],
                                    [self.ids[params[i]] for i in picked], [global_index(params[i]) for i in picked], stream)
            return
        torch._foreach_copy_(dsts, srcs)

    def __call__(self):
        opt = self.optimizer
        self.ids = {p: i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}
        slots = [(g, i, p) for g in opt.param_groups for i, p in enumerate(g["params"]) if p.grad is not None]
        grads = {p: p.grad for _, _, p in slots}
        fusable = [self._fusable(g, p, grads[p]) for g, _, p in slots]
        eight = self.state_dtype == STATE_8BIT  # O8's fused parameters stay in the chunks: skipped with them
        fused = [(g, p) for (g, _, p), f in zip(slots, fusable) if f and not eight]
        quick = {id(p) for (_, _, p), f in zip(slots, fusable) if f and eight}
        slots = [s for s, f in zip(slots, fusable) if not f or eight]
        for p in grads:
            p.grad = None  # each chunk's step sees only its own gradients
        parts = chunks(slots, CHUNK_ELEMENTS)
        several = sum(any(id(p) not in quick for _, _, p in c) for c in parts) > 1  # optimizer calls: each starts
        result, before, after = None, _group_settings(opt) if several else {}, {}  # from the groups as the step found them
        held, self.skipped_chunks, calls = len(opt.state), 0, 0
        try:
            if fused and self.model_states is not None:
                fused_update.step_remainders(opt, fused, grads, self._remainders([p for _, p in fused]))
            elif fused:
                fused_update.step(opt, fused, grads, self.state_dtype, self.rounder, self.ids)
            for chunk in parts:
                undo = None
                if any(id(p) in quick for _, _, p in chunk):
                    undo = fused_update_8bit.step(opt, [(g, p) for g, _, p in chunk if id(p) in quick], grads,
                                                  self.rounder, self.ids, self._skip_fused, self.scratch)
                    if undo is None:
                        self.skipped_chunks += 1
                        continue
                rest = [s for s in chunk if id(s[2]) not in quick]
                if not rest:
                    continue
                if calls:
                    _restore_group_settings(opt, before)
                calls, skipped = calls + 1, self.skipped_chunks
                result = self._step_chunk(rest, grads)
                if several:
                    after.update(_changed_settings(opt, before))
                if self.skipped_chunks > skipped and undo is not None:
                    undo()
        finally:
            for p, g in grads.items():
                p.grad = g
        if several:
            _restore_group_settings(opt, {**before, **after})  # one step's worth of group counters
        if fused or len(opt.state) != held:  # the fused path never re-keys: keep one order, the parameters'
            fused_update.order_state(opt, self.ids)
        if self.rounder is not None and (fused or not parts or self.skipped_chunks < len(parts)):
            self.rounder.advance()  # not after a step skipped whole (non-finite weights): it rounded nothing
        return result

    def _fusable(self, group: dict, p: torch.Tensor, grad: torch.Tensor) -> bool:
        """Whether ``p`` steps in a fused AdamW (``fused_update.py``: O7's, or the remainder
        masters' with float32 state; ``fused_update_8bit.py``: O8's) rather than the chunks."""
        if not fused_update.enabled():
            return False
        if self.model_states is not None:
            return (self.state_dtype in (None, torch.float32)
                    and fused_update.remainder_eligible(self.optimizer, group, p, grad))
        if self.rounding != "stochastic":
            return False
        if self.state_dtype == STATE_8BIT:
            return fused_update_8bit.eligible(self.optimizer, group, p, grad)
        return (self.state_dtype in (None, torch.float32, torch.bfloat16)
                and fused_update.eligible(self.optimizer, group, p, grad, self.state_dtype))

    def _step_chunk(self, chunk, grads):
        """One optimizer call on fp32 copies of the chunk's half parameters, gradients and
        half state (views of one buffer, so one allocation and one fused copy); then the
        weights, and the state when it is stored in half, are rounded back."""
        opt, swapped = self.optimizer, []
        half = [p for _, _, p in chunk if p.dtype in HALF_DTYPES]
        kept = None  # O8: what a step that would write a non-finite weight puts back
        if self.state_dtype == STATE_8BIT:
            kept = (state_8bit.keep(opt.state, [p for _, _, p in chunk]), _group_settings(opt))
        stored = [(st, k, v) for p in half if p in opt.state for st in (opt.state[p],) for k, v in st.items()
                  if torch.is_tensor(v) and v.dtype != torch.float32 and _elementwise(k, v, p)]  # cheap test first
        packed = state_8bit.held(opt.state, half) if self.state_dtype == STATE_8BIT else []
        srcs = [local(t) for t in half + [grads[p] for p in half] + [v for _, _, v in stored]]  # FSDP2: shards
        wide = []
        if srcs:
            flat = torch.empty(sum(t.numel() for t in srcs), dtype=torch.float32, device=srcs[0].device)
            wide = _unflatten_dense_tensors(flat, srcs)
            skip = 0 if self.model_states is None else len(half)  # remainder masters: combine writes the weights
            with torch.no_grad():
                torch._foreach_copy_(wide[skip:], srcs[skip:])
        state_8bit.widen(packed)
        weights, copies, grad_copies = srcs[:len(half)], wide[:len(half)], wide[len(half):2 * len(half)]
        rems = None if self.model_states is None else self._remainders(half)
        if rems is not None:  # the exact fp32 masters, not the widened bf16 weights
            combine(weights, rems, copies)
        for (st, k, v), w in zip(stored, wide[2 * len(half):]):
            st[k] = like(w, v)
        copy_of = {p: (like(c, p), like(g, p)) for p, c, g in zip(half, copies, grad_copies)}
        try:
            for group, i, p in chunk:
                if p not in copy_of:
                    p.grad = grads[p]
                    continue
                f, f.grad = copy_of[p]
                group["params"][i] = f
                state = opt.state.pop(p, None)
                if state is not None:
                    opt.state[f] = state
                swapped.append((group, i, p, f))
            result = self._optimizer_step(chunk, swapped)
            if kept is not None and self._nonfinite(chunk, flat[:sum(w.numel() for w in weights)] if half else None):
                state_8bit.restore(opt.state, kept[0], lambda p: copy_of[p][0] if p in copy_of else p)
                _restore_group_settings(opt, kept[1])
                self.skipped_chunks += 1
                return result
            with torch.no_grad():
                if rems is not None:
                    split_(weights, rems, copies)
                else:
                    self.round_into(weights, copies, half)
                in_groups = self.state_dtype == STATE_8BIT  # 8-bit caps read each param's group; counter bits its index
                self._narrow([(opt.state[f], f if in_groups else p) for _, _, p, f in swapped if f in opt.state], False,
                             {(id(st), k): v for st, k, v in stored} or {(id(st), k): (c, s) for st, k, c, s in packed},
                             {f: self.ids[p] for _, _, p, f in swapped} if in_groups else None)
            return result
        finally:
            for group, i, p, f in swapped:
                group["params"][i] = p
                state = opt.state.pop(f, None)
                if state is not None:
                    opt.state[p] = state
            for group, i, p in chunk:
                p.grad = None

    def _optimizer_step(self, chunk, swapped):
        """The optimizer's own step on the chunk's fp32 copies; at O8 with a plain AdamW / Adam,
        ampkit's arithmetic instead (``fused_update.step_fp32_``, what O8's fused kernel
        computes: here for shards whose blocks other ranks share), so that the numbers are the
        same on every path and world size."""
        opt = self.optimizer
        if (self.state_dtype == STATE_8BIT and fused_update.enabled() and len(swapped) == len(chunk)
                and all(fused_update.plain_group(opt, g) for g, _, _, _ in swapped)):
            fused_update.step_fp32_(opt, [(g, f) for g, _, _, f in swapped])
            return None
        return self.step()

    def _nonfinite(self, chunk, new_weights: Optional[torch.Tensor]) -> bool:
        """Whether the chunk's step made a weight non-finite on any rank (one sum, one host
        sync; the elements are looked at only when the sum is not finite): then the step is
        reported skipped like an overflow, naming those parameters."""
        stepped = [local(g["params"][i]).detach() for g, i, _ in chunk]  # the new weights: copies and float32 ones
        sums = [w.sum() for w, (_, _, p) in zip(stepped, chunk) if p.dtype not in HALF_DTYPES]
        sums += [] if new_weights is None else [new_weights.sum()]
        if not sums:
            return False
        bad = not torch.stack(sums).isfinite().all().item() and not all(bool(w.isfinite().all()) for w in stepped)
        return self._skip_nonfinite([slot for slot, w in zip(chunk, stepped) if not bool(w.isfinite().all())] if bad else [],
                                    sums[0].device)

    def _skip_fused(self, bad: List[torch.Tensor], device) -> bool:
        """`_skip_nonfinite` for the parameters ``bad`` of O8's fused path."""
        return self._skip_nonfinite([(g, i, p) for g in self.optimizer.param_groups for i, p in enumerate(g["params"])
                                     if any(p is b for b in bad)], device)

    def _skip_nonfinite(self, bad: list, device) -> bool:
        """Whether a chunk is skipped because its update made weights non-finite: those of the
        slots ``bad`` (``(group, index, param)``) here, or some on another rank (one flag
        reduced over the ranks); then the step is reported skipped, naming them."""
        if not all_ranks_max(torch.tensor(float(bool(bad)), device=device)).item():
            return False
        opt, name_of = self.optimizer, parameter_names(self.optimizer._ampkit.run)
        where = {id(g): k for k, g in enumerate(opt.param_groups)}
        names = [name_of.get(p, f"param_groups[{where[id(g)]}][{i}]") for g, i, p in bad]
        opt._ampkit.update_skipped()
        opt._ampkit.run.log("Non-finite weights from the optimizer's update of %s: not written, their optimizer "
                            "state kept. Skipping step.", ", ".join(names) or "another rank's shards",
                            level=logging.WARNING)
        return True

    def _remainders(self, params) -> List[torch.Tensor]:
        """Each bf16 parameter's remainder (a parameter added later starts at 0: its bf16 value)."""
        out = []
        for p in params:
            owner = next((ms for ms in self.model_states if ms.owns(p)), self.model_states[0])
            r = owner.remainders.get(p)
            if r is None:
                r = owner.remainders[p] = torch.zeros_like(local(p), dtype=torch.int16)
            out.append(r)
        return out

    def _narrow(self, states, exact: bool, stored=None, ids=None) -> None:
        """Elementwise float32 state to ``state_dtype`` (a half dtype, or 8 bits), into the
        tensors it was widened from where there are some; rounded with the run's counter bits
        (the parameter ``ids[param]``, `ids` by default), or, when ``exact`` (loaded state,
        on the grid already), to nearest."""
        if self.state_dtype is None or self.state_dtype == torch.float32:
            return
        if self.state_dtype == STATE_8BIT:
            return state_8bit.pack(states, stored or {}, self.optimizer, None if exact else self.rounder,
                                   self.ids if ids is None else ids)
        found = [(st, k, v, p, 1 + j) for st, p in states
                 for j, (k, v) in enumerate((k, v) for k, v in st.items() if _elementwise(k, v, p))
                 if v.dtype != self.state_dtype]  # stream 1 + j: the parameter's j-th elementwise state
        if not found:
            return
        stored = stored or {}
        dsts = [stored.get((id(st), k)) for st, k, *_ in found]
        dsts = [torch.empty_like(v, dtype=self.state_dtype) if d is None else d for d, (_, _, v, *_) in zip(dsts, found)]
        with torch.no_grad():
            srcs = [local(v).float() for _, _, v, *_ in found]
            if exact:
                _copy_into([local(d) for d in dsts], srcs)
            else:
                self.round_into([local(d) for d in dsts], srcs, [p for *_, p, _ in found], [s for *_, s in found])
        for (st, k, *_), d in zip(found, dsts):
            st[k] = d

    def load_state_dict(self, load: Callable, state_dict: dict) -> None:
        """``optimizer.load_state_dict``: torch casts loaded state to each parameter's dtype,
        which would round fp32 state to half; the half parameters are shown to it as fp32
        stand-ins, and the state is re-keyed (and stored as ``state_dtype``) afterwards."""
        opt, real = self.optimizer, {}
        for group in opt.param_groups:
            for i, p in enumerate(group["params"]):
                if p.dtype in HALF_DTYPES:
                    stand_in = torch.empty(0, dtype=torch.float32, device=p.device)
                    real[stand_in] = p
                    group["params"][i] = stand_in
        try:
            load(state_dict)
        finally:
            for group in opt.param_groups:
                group["params"] = [real.get(p, p) for p in group["params"]]
            for stand_in, p in real.items():
                state = opt.state.pop(stand_in, None)
                if state is not None:
                    opt.state[p] = state
            self._narrow([(opt.state[p], p) for p in real.values() if p in opt.state], True)


def _group_settings(opt) -> dict:
    """``(group index, key) -> value`` of every param group entry but ``params``."""
    return {(i, k): v for i, g in enumerate(opt.param_groups) for k, v in g.items() if k != "params"}


def _changed_settings(opt, before: dict) -> dict:
    now = _group_settings(opt)
    return {key: v for key, v in now.items() if key not in before or not _same(v, before[key])}


def _same(a, b) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        return a is b or (torch.is_tensor(a) and torch.is_tensor(b) and a.shape == b.shape and bool(torch.equal(a, b)))
    try:
        return bool(a == b)
    except Exception:  # an entry whose == is not a truth value: compare identities
        return a is b


def _restore_group_settings(opt, settings: dict) -> None:
    """Make every param group's entries but ``params`` exactly ``settings``."""
    for i, g in enumerate(opt.param_groups):
        for k in [k for k in g if k != "params" and (i, k) not in settings]:
            del g[k]
    for (i, k), v in settings.items():
        opt.param_groups[i][k] = v


def _load_state_dict(optimizer, state_dict: dict) -> None:
    """``optimizer.load_state_dict()`` at update_rounding levels: see `TransientUpdate.load_state_dict`."""
    update = optimizer._ampkit._step
    update.load_state_dict(update.load, state_dict)


def _copy_into(dsts, srcs) -> None:
    torch._foreach_copy_(dsts, srcs)


def _elementwise(key, value, p: torch.Tensor) -> bool:
    return key != "step" and torch.is_tensor(value) and value.is_floating_point() and value.shape == p.shape


def attach(opt_state, rounding: str, rounder: Optional[StochasticRounder], state_dtype: Optional[torch.dtype],
           model_states=None) -> None:
    """Make ``opt_state``'s optimizer step through a `TransientUpdate` (with the models'
    remainders as the masters when ``model_states`` is given)."""
    opt = opt_state.optimizer
    update = TransientUpdate(opt, opt_state._step, rounding, rounder, state_dtype, model_states)
    opt_state._step = update
    update.load = opt.load_state_dict
    opt.load_state_dict = types.MethodType(_load_state_dict, opt)
    held = [p for g in opt.param_groups for p in g["params"] if p in opt.state]
    update._narrow([(opt.state[p], p) for p in held if p.dtype in HALF_DTYPES], True)  # state it already had
    if state_dtype == STATE_8BIT:
        opt.register_state_dict_post_hook(state_8bit.widened_state_dict)


def attach_remainders(opt_state, originals: dict, state_dtype: Optional[torch.dtype]) -> None:
    """``master_weights="remainder"``: each bf16 parameter's fp32 master held as the weight plus
    an int16 remainder (``core/remainder.py``), starting from its fp32 value before the cast
    (of a sharded parameter: its local shard's, cut from the first rank's value); the
    optimizer steps on the exact masters through a `TransientUpdate`."""
    for group in opt_state.optimizer.param_groups:
        for p in group["params"]:
            owner = next((ms for ms in opt_state.model_states if ms.owns(p)), None)
            if p.dtype != torch.bfloat16 or owner is None or p in owner.remainders:
                continue
            original = originals.get(p)
            exact = original is not None and original.dtype == torch.float32 and original.shape == p.shape
            owner.remainders[p] = remainder(shard_of(original, p) if exact else local(p).detach().float())
    attach(opt_state, "nearest", None, state_dtype, opt_state.model_states)
