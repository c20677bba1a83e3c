"""``UpdateKind.REMAINDER``: fp32 masters held as the bf16 weight plus an int16 remainder.

Each bf16 parameter's fp32 master is the weight and its remainder (``_kernels/remainder.py``),
kept in the model's state; there is no fp32 copy between steps. The optimizer steps on the
exact masters rebuilt per chunk (`ChunkedUpdate`), which are split back into weight and
remainder; a plain AdamW / Adam with float32 state, or an exact SGD with a float32 momentum
buffer, steps them in one fused pass (``fused_update.step_remainders``,
``fused_sgd_update.step_remainders``), bit for bit O5's fused masters, and its float32
parameters in O5's fused masters' op, as O5 does. Design notes:
docs/design/update-engine.md.
"""
from typing import List

import torch

from .._kernels.remainder import combine, remainder, split_
from .chunks import ChunkedUpdate
from .shards import local, shard_of


class RemainderUpdate(ChunkedUpdate):
    """The remainder masters' update (rounding to nearest: a bf16 state too)."""

    def attach(self) -> None:
        """Each bf16 parameter's remainder, from its fp32 value before the cast (of a sharded
        parameter: its local shard's, cut from the first rank's value); then the chunks' setup."""
        opt_state = self.opt_state
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                owner = next((ms for ms in opt_state.model_states if ms.owns(p)), None)
                if p.dtype != torch.bfloat16 or owner is None or p in owner.remainders:
                    continue
                original = opt_state.originals.get(p)
                exact = original is not None and original.dtype == torch.float32 and original.shape == p.shape
                owner.remainders[p] = remainder(shard_of(original, p) if exact else local(p).detach().float())
        super().attach()

    def _fusable(self, group: dict, p: torch.Tensor, grad: torch.Tensor) -> bool:
        """Whether ``p`` steps in the remainder masters' fused AdamW or SGD (float32 state), or, a
        float32 parameter, in the fused masters' op (`_fp32_fusable`)."""
        if p.dtype == torch.float32:
            return self._fp32_fusable(group, p)
        if not self.fused_on or self.state_dtype not in (None, torch.float32):
            return False
        return self._kind().remainder_eligible(self.optimizer, group, p, grad)

    def _step_fused(self, params, grads: dict) -> None:
        half = self._step_fp32(params, grads)
        if half:
            self._kind().step_remainders(self.optimizer, half, grads, self._remainders([p for _, p in half]))

    def _widen(self, wide, srcs, half) -> None:
        """The gradients and state widened; the weights' copies are the exact fp32 masters
        (weight and remainder), not the widened bf16 weights."""
        n = len(half)
        with torch.no_grad():
            torch._foreach_copy_(wide[n:], srcs[n:])
        combine(srcs[:n], self._remainders(half), wide[:n])

    def _write_back(self, weights, copies, half) -> None:
        """The stepped masters split into weight and remainder."""
        split_(weights, self._remainders(half), copies)

    def _remainders(self, params) -> List[torch.Tensor]:
        """Each bf16 parameter's remainder (a parameter added later starts at 0: its bf16 value)."""
        out, model_states = [], self.opt_state.model_states
        for p in params:
            owner = next((ms for ms in model_states if ms.owns(p)), model_states[0])
            r = owner.remainders.get(p)
            if r is None:
                r = owner.remainders[p] = torch.zeros_like(local(p), dtype=torch.int16)
            out.append(r)
        return out
