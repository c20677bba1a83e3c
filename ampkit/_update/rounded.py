"""``UpdateKind.ROUNDED`` (O7): half weights without masters, each update computed in fp32 and rounded back.

The optimizer holds the model's half parameters and steps on their fp32 copies, chunk by
chunk (`ChunkedUpdate`); the results are rounded back stochastically (the counter bits: the
same for any chunking or sharding) or to nearest. With ``optimizer_state_dtype=torch.bfloat16``
the elementwise state is stored in bf16 between steps, rounded the same way. A plain AdamW /
Adam steps its bf16 parameters in O7's fused kernel instead (``fused_update.step``), a plain SGD in
its own (``fused_sgd_update.step``), and their float32 parameters in the fused masters' op. Design
notes: docs/design/update-engine.md.
"""
import torch

from .chunks import ChunkedUpdate


class RoundedUpdate(ChunkedUpdate):
    """O7's update: the chunks, or O7's fused AdamW or SGD for the parameters it takes."""

    def _fusable(self, group: dict, p: torch.Tensor, grad: torch.Tensor) -> bool:
        """Whether ``p`` steps in O7's fused AdamW or SGD (stochastic rounding, float32 or bf16
        state), or, a float32 parameter, in the fused masters' op (`_fp32_fusable`)."""
        if p.dtype == torch.float32:
            return self._fp32_fusable(group, p)
        if not self.fused_on or not self.stochastic:
            return False
        return (self.state_dtype in (None, torch.float32, torch.bfloat16)
                and self._kind().eligible(self.optimizer, group, p, grad, self.state_dtype))

    def _step_fused(self, params, grads: dict) -> None:
        half = self._step_fp32(params, grads)
        if half:
            self._kind().step(self.optimizer, half, grads, self.state_dtype, self.rounder, self.ids)
