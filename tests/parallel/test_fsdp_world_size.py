"""O7 and O8 on FSDP2 give the single process's weights bit for bit, given identical gradients.

The rounding bits are a function of each element's index in its full parameter
(``core/counter_bits.py``) and the fused AdamW computes each element on its own, so a
2-rank run (uneven dim-0 shards) and one process agree exactly. The gradients are made
identical by a loss linear in the weights: every rank's gradient is the same coefficient
tensor, and FSDP2's average of equal values is that value.

O8's 8-bit state draws its codes from the same counter bits, but its blocks (and so their
scales) are per shard: it matches the single process where the shards are cut at multiples
of the block (256 elements), as in :class:`Aligned`.
"""
import pytest
import torch
from torch import nn

import ampkit
from ampkit.parallel import full_state_dict

from ._launch import run

pytestmark = pytest.mark.slow

STEPS = 4
CASES = {"O7": ({}, "adamw"), "O7/bf16_state": ({"optimizer_state_dtype": torch.bfloat16}, "adamw"),
         "O7/adam": ({}, "adam"), "O8": ({}, "adamw"), "O8/adam": ({}, "adam")}


class Linear(nn.Module):
    """Odd sizes: 2 ranks hold dim-0 shards of 4 and 3 rows, 2 and 1, 4 and 3, 2 and 1."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(5, 7), nn.Linear(7, 3)

    def forward(self, step):
        g = torch.Generator().manual_seed(int(step))
        return sum((p.float() * torch.randn(p.shape, generator=g)).sum() for p in self.parameters())


class Aligned(Linear):
    """Shards cut at multiples of 256 elements, uneven: 2 ranks hold 2 and 1 rows of 256, 1 and 1."""

    def __init__(self):
        nn.Module.__init__(self)
        self.a, self.b = nn.Linear(256, 3, bias=False), nn.Linear(256, 2, bias=False)


def _model(case: str) -> nn.Module:
    return Aligned() if case.startswith("O8") else Linear()


def _trained(case: str, distributed: bool):
    kwargs, kind = CASES[case]
    torch.manual_seed(0)
    model = _model(case)
    opt = (torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1) if kind == "adamw"
           else torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=0.1))
    model, opt = ampkit.initialize(model, opt, opt_level=case.split("/")[0], verbosity=0, fsdp=distributed,
                                   **kwargs)
    for step in range(STEPS):
        opt.zero_grad()
        loss = model(torch.tensor(step))
        with ampkit.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
    return full_state_dict(model) if distributed else {k: v.float() for k, v in model.state_dict().items()}


def _worker(rank, world_size):
    return {case: {k: v.clone() for k, v in _trained(case, True).items()} for case in CASES}


@pytest.fixture(scope="module")
def two_ranks():
    return run(_worker, 2, timeout=900, pg_timeout=600)


@pytest.mark.parametrize("case", CASES)
def test_two_ranks_equal_one_process_bit_for_bit(two_ranks, case):
    single = _trained(case, False)
    got = two_ranks[0][case]
    assert got.keys() == single.keys()
    for k in single:
        assert torch.equal(got[k], single[k]), (case, k)
    torch.manual_seed(0)
    start = {k: v.float() for k, v in _model(case).to(torch.bfloat16).state_dict().items()}
    assert all(not torch.equal(single[k], start[k]) for k in single)  # every tensor moved
