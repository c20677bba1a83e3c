"""O7 and O8 on FSDP2 give the single process's weights bit for bit, given identical gradients.

The rounding bits are a function of each element's index in its full parameter
(``_kernels/counter_bits.py``) and the fused AdamW computes each element on its own, so a
2-rank run (uneven dim-0 shards) and one process agree exactly. The gradients are made
identical by a loss linear in the weights: every rank's gradient is the same coefficient
tensor, and FSDP2's average of equal values is that value.

O8's 8-bit state draws its codes from the same counter bits, and its blocks are the full
parameter's: a block cut between two ranks takes its scale from its maximum over both
(``_update/shared_blocks.py``), so O8 matches the single process with shards cut anywhere,
as in :class:`Unaligned`: its weights and its optimizer state (codes and scales) bit for bit.
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


class Unaligned(Linear):
    """Shards cut inside 256-element blocks: on 2 ranks ``a.weight`` (5 rows of 300) at 900,
    in its block 3, ``b.weight`` (7 of 5) and the biases inside their only block; on 3 ranks
    at 600 and 1200 (blocks 2 and 4), and so on. A large value in one rank's part of a split
    block sets the scale of the other's. ``c.weight`` (4 rows of 256) splits no block on 1 to
    4 ranks nor on a 2 x 2 mesh: O8's fused kernel steps its shards."""

    def __init__(self):
        nn.Module.__init__(self)
        self.a, self.b, self.c = nn.Linear(300, 5), nn.Linear(5, 7), nn.Linear(256, 4, bias=False)

    def forward(self, step):
        g = torch.Generator().manual_seed(int(step))
        coefficients = [torch.randn(p.shape, generator=g) for p in self.parameters()]
        coefficients[0].view(-1)[[800, 950]] *= 1000.0  # in block 3, one on each side of the 2-rank cut
        return sum((p.float() * c).sum() for p, c in zip(self.parameters(), coefficients))


def _model(case: str) -> nn.Module:
    return Unaligned() if case.startswith("O8") else Linear()


def _trained(case: str, distributed: bool, mesh=None):
    """``case`` trained STEPS steps, in one process or on FSDP2 (on ``mesh`` if given):
    (full weights, :func:`_optimizer_state`)."""
    kwargs, kind = CASES[case]
    if mesh is not None:
        kwargs = {**kwargs, "fsdp_kwargs": {"mesh": mesh}}
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
    weights = full_state_dict(model) if distributed else {k: v.float() for k, v in model.state_dict().items()}
    return weights, _optimizer_state(model, opt, distributed)


def _optimizer_state(model, opt, distributed: bool) -> dict:
    """The whole optimizer state (float32, O8's widened) as the single process holds it, and,
    at O8, each full parameter's codes and scales as stored (the shards' gathered)."""
    if distributed:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        state = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))["state"]
    else:
        state = opt.state_dict()["state"]
    state = {str(k): {key: v.clone() for key, v in st.items()} for k, st in state.items()}
    names = [n for n, _ in model.named_parameters()]
    stored = {}
    for name, p in zip(names, model.parameters()):
        for key, v in opt.state[p].items():
            if key.endswith((".codes", ".scales")):
                stored[f"{name}/{key}"] = _gathered(v, p) if distributed else v.clone()
    return {"state": state if distributed else {names[int(k)]: st for k, st in state.items()}, "stored": stored}


def _gathered(v, p):
    """The full tensor of a shard's codes (a DTensor), or the scales of the blocks of the full
    parameter (each rank's local list, a split block's scale once: the ranks' copies are equal)."""
    import torch.distributed as dist

    from ampkit._update.shared_blocks import block_first

    if hasattr(v, "full_tensor"):
        return v.full_tensor().clone()
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (block_first(p) // 256, v.clone()))
    full = {}
    for start, scales in parts:
        for j, s in enumerate(scales.tolist()):
            assert full.setdefault(start + j, s) == s, "a split block's scale differs between ranks"
    return torch.tensor([full[b] for b in sorted(full)])


def _worker(rank, world_size):
    return {case: _trained(case, True) for case in CASES}


@pytest.fixture(scope="module")
def two_ranks():
    return run(_worker, 2, timeout=900, pg_timeout=600)


@pytest.mark.parametrize("case", CASES)
def test_two_ranks_equal_one_process_bit_for_bit(two_ranks, case):
    """Weights, the float32 optimizer state and (O8) the stored codes and scales."""
    single, single_opt = _trained(case, False)
    got, got_opt = two_ranks[0][case]
    assert got.keys() == single.keys()
    for k in single:
        assert torch.equal(got[k], single[k]), (case, k)
    torch.manual_seed(0)
    start = {k: v.float() for k, v in _model(case).to(torch.bfloat16).state_dict().items()}
    assert all(not torch.equal(single[k], start[k]) for k in single)  # every tensor moved
    assert_same_optimizer_state(got_opt, single_opt, case)


def assert_same_optimizer_state(got: dict, want: dict, case: str) -> None:
    """Bit for bit, keys and dtypes included (FSDP2 names the state by parameter name, the
    single process by index: :func:`_optimizer_state` names both)."""
    assert got["state"].keys() == want["state"].keys(), case
    for name, st in want["state"].items():
        assert got["state"][name].keys() == st.keys(), (case, name)
        for key, v in st.items():
            mine = got["state"][name][key]
            assert mine.dtype == v.dtype and torch.equal(mine, v), (case, name, key)
    assert got["stored"].keys() == want["stored"].keys(), case
    assert (len(want["stored"]) > 0) == case.startswith("O8"), case
    for k, v in want["stored"].items():
        assert got["stored"][k].dtype == v.dtype and torch.equal(got["stored"][k], v), (case, k)
