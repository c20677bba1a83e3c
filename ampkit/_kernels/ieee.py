"""Float32 operations rounded once, as IEEE 754 (and C's ``sqrtf``) define them, where
torch's CPU kernels are not: its float32 ``sqrt`` returns a neighbour of the correctly
rounded root for about a fifth of inputs (torch 2.13, any ``ATEN_CPU_CAPABILITY``). The
eager references of the fused C kernels use these, so that kernel and reference agree bit
for bit.
"""
import torch

__all__ = ["sqrt"]


def sqrt(x: torch.Tensor) -> torch.Tensor:
    """The correctly rounded float32 square root of float32 ``x`` (a new tensor): the float64
    root, rounded once more (a float64 root within an ulp of exact never lies across a float32
    rounding boundary: a float32's root is never that close to a midpoint)."""
    return x.double().sqrt_().float()
