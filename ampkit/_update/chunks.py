"""The chunked update: the optimizer steps on fp32 copies of half parameters, one chunk at a time.

`ChunkedUpdate` is the step that the rounded (O7), eight-bit (O8) and remainder-master
updates share: chunks of at most `CHUNK_ELEMENTS` half elements, their fp32 copies (views of
one buffer), one optimizer call per chunk, the results written back, and the load of a
checkpoint in fp32. Design notes: docs/design/update-engine.md.
"""
from typing import List

import torch
from torch._utils import _unflatten_dense_tensors

from .._config.levels import HALF_DTYPES
from . import fused_sgd_update, fused_update
from .base import OptimizerUpdate
from .shards import global_index, like, local

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


class ChunkedUpdate(OptimizerUpdate):
    """The shared chunked step. Hooks, by when they run: `attach`; `step`; `before_load` and
    `after_load` around ``optimizer.load_state_dict`` (torch's load hooks). A subclass says
    which parameters step fused (`_fusable`, `_step_fused`) and how the weights are widened
    and written back (`_widen`, `_write_back`)."""

    eager_under_compile = True  # its per-step gradient and state swaps would re-trace every step

    def __init__(self, opt_state):
        super().__init__(opt_state)
        props = opt_state.run.properties
        self.rounder = opt_state.run.rounder
        self.stochastic = props.update_rounding == "stochastic"  # else to nearest
        self.state_dtype = props.optimizer_state_dtype
        self.ids = {}  # parameter -> its index among the optimizer's (the counter bits' tensor)
        self.skipped_chunks = 0  # this step's chunks that wrote nothing (non-finite weights)
        self.fused_on = True  # `fused_update.enabled()` this step
        self.paired_bits = False  # O8's weights drawn two to a counter word (`state_8bit.paired_bits`)
        self.held_back = {}  # between the load hooks: half parameter -> (its state's keys, tensors held back)

    def attach(self) -> None:
        """Load through `before_load` / `after_load`; state the optimizer already has is stored
        as `state_dtype`."""
        opt = self.optimizer
        opt.register_load_state_dict_pre_hook(_before_load)
        opt.register_load_state_dict_post_hook(_after_load)
        held = [p for g in opt.param_groups for p in g["params"] if p in opt.state]
        self._narrow([(opt.state[p], p) for p in held if p.dtype in HALF_DTYPES], True)

    def step(self) -> tuple:
        """The fused parameters' step, then one optimizer call per chunk."""
        opt = self.optimizer
        self.ids = {p: i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}
        slots = [(g, i, p) for g in opt.param_groups for i, p in enumerate(g["params"]) if p.grad is not None]
        grads = {p: p.grad for _, _, p in slots}
        self.fused_on = fused_update.enabled()  # read once a step: a switch lookup per tensor costs 3 us
        fused, slots = self._split(slots, grads)
        for p in grads:
            p.grad = None  # each chunk's step sees only its own gradients
        parts = chunks(slots, CHUNK_ELEMENTS)
        held, self.skipped_chunks = len(opt.state), 0
        try:
            if fused:
                self._step_fused(fused, grads)
            result = self._step_chunks(parts, grads)
        finally:
            for p, g in grads.items():
                p.grad = g
        if fused or len(opt.state) != held:  # the fused path never re-keys: keep one order, the parameters'
            fused_update.order_state(opt, self.ids)
        if self.rounder is not None and (fused or not parts or self.skipped_chunks < len(parts)):
            self.rounder.advance()  # not after a step skipped whole (non-finite weights): it rounded nothing
        return result, ()

    def _split(self, slots, grads):
        """``(group, param)`` of the slots that step fused, and the slots left for the chunks."""
        fusable = [self._fusable(g, p, grads[p]) for g, _, p in slots]
        return [(g, p) for (g, _, p), f in zip(slots, fusable) if f], [s for s, f in zip(slots, fusable) if not f]

    def _fusable(self, group: dict, p: torch.Tensor, grad: torch.Tensor) -> bool:
        raise NotImplementedError  # each kind's fused AdamW decides

    def _step_fused(self, params, grads: dict) -> None:
        raise NotImplementedError

    def _kind(self):
        """The fused update's module for this optimizer: ``fused_sgd_update`` for an exact SGD, else
        ``fused_update`` (AdamW / Adam; each checks what it takes)."""
        return fused_sgd_update if fused_sgd_update.is_sgd(self.optimizer) else fused_update

    def _fp32_fusable(self, group: dict, p: torch.Tensor) -> bool:
        """Whether float32 ``p`` (a norm kept in fp32) steps in the fused masters' op (`_step_fp32`):
        the fused path on, an exact AdamW / Adam or SGD whose master kernel takes it, with no model
        weight to write (``master_eligible``; read before the gradients are set aside)."""
        return self.fused_on and p.dtype == torch.float32 and self._kind().master_eligible(self.optimizer, group, p, None)

    def _step_fp32(self, params, grads: dict) -> list:
        """The float32 ones of the fused ``params`` (``(group, p)``) stepped in the fused masters'
        op (`_fp32_fusable`), their gradients lent back for it; the others, returned."""
        fp32 = [(g, p) for g, p in params if p.dtype == torch.float32]
        if not fp32:
            return params
        for _, p in fp32:
            p.grad = grads[p]
        try:
            self._kind().step_masters(self.optimizer, [(g, p, None) for g, p in fp32])
        finally:
            for _, p in fp32:
                p.grad = None
        return [(g, p) for g, p in params if p.dtype != torch.float32]

    def _step_chunks(self, parts, grads):
        """Each chunk's optimizer call starts from the param groups' settings as the step found
        them; the settings a call changed (a custom optimizer's step counter in its groups) are
        kept once, so the optimizer sees one step per training step at any model size."""
        opt = self.optimizer
        several = sum(bool(self._optimizer_slots(c)) for c in parts) > 1
        result, before, after, calls = None, group_settings(opt) if several else {}, {}, 0
        for chunk in parts:
            rest, undo = self._fused_in_chunk(chunk, grads)
            if not rest:
                continue
            if calls:
                restore_group_settings(opt, before)
            calls, skipped = calls + 1, self.skipped_chunks
            result = self._step_chunk(rest, grads)
            if several:
                after.update(_changed_settings(opt, before))
            if self.skipped_chunks > skipped and undo is not None:
                undo()
        if several:
            restore_group_settings(opt, {**before, **after})  # one step's worth of group counters
        return result

    def _optimizer_slots(self, chunk) -> list:
        """The chunk's slots that the optimizer call steps (all of them here)."""
        return chunk

    def _fused_in_chunk(self, chunk, grads):
        """``(slots left for the optimizer call, undo or None)``: nothing steps fused inside a chunk here."""
        return chunk, None

    def _step_chunk(self, chunk, grads):
        """One optimizer call on fp32 copies of the chunk's half parameters, gradients and
        half state (views of one buffer, so one allocation and one fused copy); then the
        weights, and the state when it is stored narrower, are written back."""
        opt, swapped = self.optimizer, []
        half = [p for _, _, p in chunk if p.dtype in HALF_DTYPES]
        kept = self._keep(chunk)
        stored = [(st, k, v) for p in half if p in opt.state for st in (opt.state[p],) for k, v in st.items()
                  if torch.is_tensor(v) and v.dtype != torch.float32 and _elementwise(k, v, p)]  # cheap test first
        srcs = [local(t) for t in half + [grads[p] for p in half] + [v for _, _, v in stored]]  # FSDP2: shards
        wide, flat = [], None
        if srcs:
            flat = torch.empty(sum(t.numel() for t in srcs), dtype=torch.float32, device=srcs[0].device)
            wide = _unflatten_dense_tensors(flat, srcs)
            self._widen(wide, srcs, half)
        packed = self._widen_state(half)
        weights, copies, grad_copies = srcs[:len(half)], wide[:len(half)], wide[len(half):2 * len(half)]
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
            if self._skips(chunk, kept, copy_of, flat[:sum(w.numel() for w in weights)] if half else None):
                return result
            with torch.no_grad():
                self._write_back(weights, copies, half)
                self._store_state(swapped, {(id(st), k): v for st, k, v in stored}, packed)
            return result
        finally:
            for group, i, p, f in swapped:
                group["params"][i] = p
                state = opt.state.pop(f, None)
                if state is not None:
                    opt.state[p] = state
            for group, i, p in chunk:
                p.grad = None

    def _keep(self, chunk):
        """What a chunk that is skipped puts back (nothing is skipped here)."""
        return None

    def _widen(self, wide, srcs, half) -> None:
        """Fill the fp32 views ``wide`` from ``srcs`` (the local parts of the weights ``half``,
        their gradients, their half state): one fused copy."""
        with torch.no_grad():
            torch._foreach_copy_(wide, srcs)

    def _widen_state(self, half) -> list:
        """State stored in a form a copy cannot widen (8-bit codes), widened; none here."""
        return []

    def _optimizer_step(self, chunk, swapped):
        """The optimizer's own step on the chunk's fp32 copies."""
        return self.own_step()

    def _skips(self, chunk, kept, copy_of, new_weights) -> bool:
        """Whether the chunk's update is dropped after the optimizer call (never here)."""
        return False

    def _write_back(self, weights, copies, half) -> None:
        """The stepped fp32 copies into the half weights, rounded."""
        self.round_into(weights, copies, half)

    def _store_state(self, swapped, stored: dict, packed: list) -> None:
        """The chunk's state back as `state_dtype`, into the tensors it was widened from."""
        opt = self.optimizer
        self._narrow([(opt.state[f], p) for _, _, p, f in swapped if f in opt.state], False, stored)

    def round_into(self, dsts: List[torch.Tensor], srcs: List[torch.Tensor], params: List[torch.Tensor],
                   streams=None) -> None:
        """``dsts[i] = srcs[i]`` (float32 into half, local shards), rounded stochastically with
        the counter bits of ``params[i]`` (the parameter ``dsts[i]`` is, or whose state it is)
        and ``streams[i]`` (0, the weight, by default), or to nearest; ``srcs`` may be
        overwritten."""
        if not dsts:
            return
        if self.stochastic and all(d.dtype == torch.bfloat16 for d in dsts):
            streams = streams or [0] * len(dsts)
            for stream in sorted(set(streams)):
                picked = [i for i, s in enumerate(streams) if s == stream]
                self.rounder.round_([dsts[i] for i in picked], [srcs[i] for i in picked],
                                    [self.ids[params[i]] for i in picked], [global_index(params[i]) for i in picked], stream,
                                    self.paired_bits and stream == 0)
            return
        torch._foreach_copy_(dsts, srcs)

    def _narrow(self, states, exact: bool, stored=None) -> None:
        """Elementwise float32 state to ``state_dtype`` (a half dtype), into the tensors it was
        widened from where there are some (``stored``); rounded with the run's counter bits,
        or, when ``exact`` (loaded state, on the grid already), to nearest."""
        if self.state_dtype is None or self.state_dtype == torch.float32:
            return
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
                torch._foreach_copy_([local(d) for d in dsts], srcs)
            else:
                self.round_into([local(d) for d in dsts], srcs, [p for *_, p, _ in found], [s for *_, s in found])
        for (st, k, *_), d in zip(found, dsts):
            st[k] = d

    def before_load(self, state_dict: dict):
        """torch casts loaded state to its parameter's dtype, which would round fp32 state to
        half: the tensors (but ``step``) of the half parameters' states are held back from it
        (the caller's dict is not changed), for `after_load`."""
        self.held_back = {}
        saved = _saved_ids(state_dict)
        if saved is None:
            return None  # torch's own checks name what is wrong
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        state = dict(state_dict["state"])
        for i, p in zip(saved, params):
            entry = state.get(i)
            if p.dtype not in HALF_DTYPES or not isinstance(entry, dict):
                continue
            taken = {k: v for k, v in entry.items() if k != "step" and torch.is_tensor(v)}
            if taken:
                self.held_back[p] = (list(entry), taken)
                state[i] = {k: v for k, v in entry.items() if k not in taken}
        return {**state_dict, "state": state}

    def after_load(self) -> None:
        """The held-back tensors in float32 (as torch would cast them for an fp32 parameter),
        in their saved key order, then stored as `state_dtype`."""
        opt, held, self.held_back = self.optimizer, self.held_back, {}
        for p, (keys, taken) in held.items():
            loaded = opt.state[p]
            wide = {k: v.to(dtype=torch.float32, device=p.device) for k, v in taken.items()}
            opt.state[p] = {k: wide[k] if k in wide else loaded[k] for k in keys}
        half = [p for g in opt.param_groups for p in g["params"] if p.dtype in HALF_DTYPES and p in opt.state]
        self._narrow([(opt.state[p], p) for p in half], True)


def _before_load(optimizer, state_dict: dict):
    return optimizer._ampkit.update.before_load(state_dict)


def _after_load(optimizer) -> None:
    optimizer._ampkit.update.after_load()


def _saved_ids(state_dict) -> "list | None":
    """The saved parameter ids in group order, or None where the dict is not a state dict."""
    try:
        if not isinstance(state_dict["state"], dict):
            return None
        return [i for g in state_dict["param_groups"] for i in g["params"]]
    except (KeyError, TypeError):
        return None


def group_settings(opt) -> dict:
    """``(group index, key) -> value`` of every param group entry but ``params``."""
    return {(i, k): v for i, g in enumerate(opt.param_groups) for k, v in g.items() if k != "params"}


def _changed_settings(opt, before: dict) -> dict:
    now = group_settings(opt)
    return {key: v for key, v in now.items() if key not in before or not _same(v, before[key])}


def _same(a, b) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        return a is b or (torch.is_tensor(a) and torch.is_tensor(b) and a.shape == b.shape and bool(torch.equal(a, b)))
    try:
        return bool(a == b)
    except Exception:  # an entry whose == is not a truth value: compare identities
        return a is b


def restore_group_settings(opt, settings: dict) -> None:
    """Make every param group's entries but ``params`` exactly ``settings``."""
    for i, g in enumerate(opt.param_groups):
        for k in [k for k in g if k != "params" and (i, k) not in settings]:
            del g[k]
    for (i, k), v in settings.items():
        opt.param_groups[i][k] = v


def _elementwise(key, value, p: torch.Tensor) -> bool:
    return key != "step" and torch.is_tensor(value) and value.is_floating_point() and value.shape == p.shape
