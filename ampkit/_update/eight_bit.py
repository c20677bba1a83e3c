"""``UpdateKind.EIGHT_BIT`` (O8): O7's update with the optimizer state in 8 bits between steps.

The elementwise state is stored as 8-bit codes with per-block scales (``state_8bit.py``),
widened to float32 for each chunk's step and packed again after it. A plain AdamW / Adam on
CPU steps its bf16 parameters in O8's one-pass kernel (``fused_update_8bit.py``; an exact
``torch.optim.SGD`` with momentum in ``fused_sgd_update_8bit.py``) inside the
same chunks. A chunk whose update would write a non-finite weight writes nothing: its weights,
float32 parameters and state stay, and the step is reported skipped. Design notes:
docs/design/update-engine.md.
"""
import logging
from typing import List, Optional

import torch

from .._config.levels import HALF_DTYPES
from .._run.overflow import all_ranks_max, parameter_names
from . import fused_sgd_update, fused_sgd_update_8bit, fused_update, fused_update_8bit, state_8bit
from .chunks import ChunkedUpdate, group_settings, restore_group_settings
from .shards import local


class EightBitUpdate(ChunkedUpdate):
    """O8's update: its fused parameters step inside the chunks, so a skipped chunk skips them too."""

    def __init__(self, opt_state):
        super().__init__(opt_state)
        self.quick = set()  # this step's parameters (ids) that O8's fused kernel steps
        self.scratch = {}  # the fused kernel's backup buffers, kept from step to step
        self.paired_bits = state_8bit.paired_bits(self.optimizer)

    def attach(self) -> None:
        """The chunks' setup; ``optimizer.state_dict()`` widens the packed state (`state_8bit.widened_state_dict`)."""
        super().attach()
        self.optimizer.register_state_dict_post_hook(state_8bit.widened_state_dict)

    def _split(self, slots, grads):
        self.quick = {id(p) for g, _, p in slots if self._fusable(g, p, grads[p])}
        return [], slots

    def _fusable(self, group: dict, p: torch.Tensor, grad: torch.Tensor) -> bool:
        """Whether ``p`` steps in O8's fused AdamW or SGD."""
        return self.fused_on and self.stochastic and self._fused().eligible(self.optimizer, group, p, grad)

    def _fused(self):
        """The fused step's module: O8's SGD for an exact ``torch.optim.SGD``, else O8's AdamW."""
        return fused_sgd_update_8bit if fused_sgd_update.is_sgd(self.optimizer) else fused_update_8bit

    def _optimizer_slots(self, chunk) -> list:
        return [s for s in chunk if id(s[2]) not in self.quick]

    def _fused_in_chunk(self, chunk, grads):
        """The chunk's fused parameters stepped first; a fused step that would write a
        non-finite weight wrote nothing, and the chunk is skipped whole."""
        mine = [(g, p) for g, _, p in chunk if id(p) in self.quick]
        if not mine:
            return chunk, None
        undo = self._fused().step(self.optimizer, mine, grads, self.rounder, self.ids, self._skip_fused, self.scratch)
        if undo is None:
            self.skipped_chunks += 1
            return [], None
        return self._optimizer_slots(chunk), undo

    def _keep(self, chunk):
        return state_8bit.keep(self.optimizer.state, [p for _, _, p in chunk]), group_settings(self.optimizer)

    def _widen_state(self, half) -> list:
        packed = state_8bit.held(self.optimizer.state, half)
        state_8bit.widen(packed)
        return packed

    def _optimizer_step(self, chunk, swapped):
        """With a plain AdamW / Adam, ampkit's arithmetic (``fused_update.step_fp32_``, what O8's
        fused kernel computes: here for shards whose blocks other ranks share), so that the
        numbers are the same on every path and world size; a chunk of float32 parameters only
        (norms kept in fp32: O8's fused kernel took the rest) in the fused masters' op, as at O5
        and O7; else the optimizer's own step."""
        opt = self.optimizer
        if not swapped and all(self._fp32_fusable(g, p) for g, _, p in chunk):
            self._kind().step_masters(opt, [(g, p, None) for g, _, p in chunk])
            return None
        if (self.fused_on and len(swapped) == len(chunk)
                and all(fused_update.plain_group(opt, g) for g, _, _, _ in swapped)):
            fused_update.step_fp32_(opt, [(g, f) for g, _, _, f in swapped])
            return None
        return self.own_step()

    def _skips(self, chunk, kept, copy_of, new_weights) -> bool:
        """A chunk whose update made a weight non-finite: its state and group settings put back."""
        if not self._nonfinite(chunk, new_weights):
            return False
        state_8bit.restore(self.optimizer.state, kept[0], lambda p: copy_of[p][0] if p in copy_of else p)
        restore_group_settings(self.optimizer, kept[1])
        self.skipped_chunks += 1
        return True

    def _store_state(self, swapped, stored: dict, packed: list) -> None:
        """8-bit caps read each parameter's group; counter bits its index."""
        opt = self.optimizer
        self._narrow([(opt.state[f], f) for _, _, p, f in swapped if f in opt.state], False,
                     stored or {(id(st), k): (c, s) for st, k, c, s in packed}, {f: self.ids[p] for _, _, p, f in swapped})

    def _narrow(self, states, exact: bool, stored=None, ids=None) -> None:
        """Elementwise float32 state packed in 8 bits (into the codes and scales it was widened
        from, ``stored``); codes rounded with the run's counter bits (of parameter ``ids[param]``,
        `ids` by default), or, when ``exact`` (loaded state), to nearest."""
        state_8bit.pack(states, stored or {}, self.optimizer, None if exact else self.rounder,
                        self.ids if ids is None else ids)

    def _nonfinite(self, chunk, new_weights: Optional[torch.Tensor]) -> bool:
        """Whether the chunk's step made a weight non-finite on any rank (one sum, one host
        sync; the elements are looked at only when the sum is not finite)."""
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
        opt, run = self.optimizer, self.opt_state.run
        name_of, where = parameter_names(run), {id(g): k for k, g in enumerate(opt.param_groups)}
        names = [name_of.get(p, f"param_groups[{where[id(g)]}][{i}]") for g, i, p in bad]
        self.opt_state.update_skipped()
        run.log("Non-finite weights from the optimizer's update of %s: not written, their optimizer "
                "state kept. Skipping step.", ", ".join(names) or "another rank's shards", level=logging.WARNING)
        return True
