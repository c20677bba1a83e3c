"""ieee.sqrt is the correctly rounded float32 root: checked exactly in float64 arithmetic."""
import math

import torch

from ampkit._kernels import ieee


def test_sqrt_is_correctly_rounded():
    """``r = sqrt(x)`` is the nearest float32 to the root iff ``(r - u/2)**2 <= x <= (r + u/2)**2``
    (``u`` the gap to the next float32 around ``r``); ``r`` has 24 bits, so ``r +- u/2`` fits
    25 and its square 50: exact in float64. Over every binade, subnormals included."""
    g = torch.Generator().manual_seed(0)
    x = torch.ldexp(torch.rand(200_000, generator=g) + 1.0, torch.randint(-149, 127, (200_000,), generator=g))
    r = ieee.sqrt(x)
    assert r.dtype == torch.float32 and r.shape == x.shape
    up = torch.nextafter(r, torch.tensor(math.inf)).double()
    down = torch.nextafter(r, torch.tensor(0.0)).double()
    r64, x64 = r.double(), x.double()
    lo, hi = (r64 + down) / 2, (r64 + up) / 2  # exact: one more bit than r
    assert (lo * lo <= x64).all() and (x64 <= hi * hi).all()


def test_sqrt_of_special_values():
    x = torch.tensor([0.0, -0.0, math.inf, math.nan, -1.0, 4.0, 2.0 ** -148])
    r = ieee.sqrt(x)
    assert r[0].item() == 0.0 and math.copysign(1, r[1].item()) == -1 and r[2].item() == math.inf
    assert math.isnan(r[3].item()) and math.isnan(r[4].item()) and r[5].item() == 2.0 and r[6].item() == 2.0 ** -74
