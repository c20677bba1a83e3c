"""The update family's rows (``families/update.py``), per optimizer: ampkit's levels through their
fused update and through the optimizer's own step (``AMPKIT_FUSED=0``), torch's fp32 optimizers and
the peers (``benchmarks/peers.py``) beside them; per row the bytes per parameter it must move, the
bytes its kernels move where counted, and how to build it."""
from functools import partial
from typing import Callable, NamedTuple, Optional

import torch

import ampkit
import peers
from ampkit._config.levels import OPT_LEVELS
from ampkit._update import fused_update
from ampkit.footprint import persistent_bytes

LR = {"AdamW": 1e-3, "SGD": 0.1}
BASE = {"AdamW": torch.optim.AdamW, "SGD": partial(torch.optim.SGD, **peers.SGD)}  # what ampkit's levels wrap
REMAINDER = {"master_weights": "remainder"}
BF16_STATE = {"optimizer_state_dtype": torch.bfloat16}
KERNEL = "ampkit fused AdamW fp32"  # _kernels/fused_masters.py on a float32 model, against torch's AdamW(fused=True)


class Variant(NamedTuple):
    level: Optional[str]  # an ampkit opt level; None: ``make(params, lr)`` on a model of ``dtype``
    overrides: dict  # initialize's options beside the level
    fused: bool  # AMPKIT_FUSED while it steps
    ideal: int  # the fewest bytes per parameter the update reads and writes, each tensor once
    moved: Optional[int] = None  # the bytes per parameter its kernels move, where counted
    make: Optional[Callable] = None
    dtype: torch.dtype = torch.float32
    needs: str = "torch"  # the module it imports


class KernelAdamW:
    """A float32 model's ``torch.optim.AdamW`` stepped by ampkit's fused fp32 kernel (the O5
    masters' update without the bf16 model copy): its state, its hyperparameters."""

    def __init__(self, params, lr):
        self.opt = torch.optim.AdamW(params, lr=lr)

    def zero_grad(self):
        self.opt.zero_grad()

    def step(self):
        fused_update.step_masters(self.opt, [(g, p, None) for g in self.opt.param_groups for p in g["params"]
                                             if p.grad is not None])


def _peers(table: dict, ideal: dict) -> dict:
    return {name: Variant(None, {}, True, ideal[name], make=ctor, dtype=torch.bfloat16, needs=module)
            for name, (module, ctor) in table.items()}


ADAMW = {  # moved: O5's fused row counts the widening into fp32 master gradients (2 read, 4 written); O8's, 4 B of backups
    "O5": Variant("O5", {}, True, 2 + 8 + 16 + 2, 6 + 30),
    "O5 eager": Variant("O5", {}, False, 2 + 8 + 16 + 2, 100),
    "remainder": Variant("O5", REMAINDER, True, 6 + 4 + 16, 2 + 26),
    "remainder eager": Variant("O5", REMAINDER, False, 6 + 4 + 16),
    "O7 fused": Variant("O7", {}, True, 4 + 2 + 16, 2 + 4 + 2 + 16),
    "O7 eager": Variant("O7", {}, False, 4 + 2 + 16, 135),
    "O7 bf16 state fused": Variant("O7", BF16_STATE, True, 4 + 2 + 8, 2 + 4 + 2 + 8),
    "O7 bf16 state eager": Variant("O7", BF16_STATE, False, 4 + 2 + 8, 215),
    "O8": Variant("O8", {}, True, 4 + 2 + 4, 2 + 4 + 2 + 4 + 4),
    "O8 eager": Variant("O8", {}, False, 4 + 2 + 4, 600),
    KERNEL: Variant(None, {}, True, 4 + 8 + 16, 4 + 8 + 16, make=KernelAdamW),
    "torch AdamW fused fp32": Variant(None, {}, True, 4 + 8 + 16, 4 + 8 + 16, make=partial(torch.optim.AdamW, fused=True)),
    **_peers(peers.PEERS, {"plain bf16 (control)": 4 + 2 + 8, "torchao AdamW SR": 4 + 2 + 8,
                           "torchao AdamW8bit SR": 4 + 2 + 4, "optimi AdamW Kahan": 4 + 2 + 8 + 4, "bnb AdamW8bit": 4 + 2 + 4}),
}

SGD = {  # one momentum buffer: 8 B read and written in fp32, 4 in bf16, 2 in 8 bits; moved: as AdamW's
    "O5": Variant("O5", {}, True, 2 + 8 + 8 + 2, 6 + 22),  # _update/fused_sgd_update.py's one pass
    "O5 eager": Variant("O5", {}, False, 2 + 8 + 8 + 2),
    "remainder": Variant("O5", REMAINDER, True, 6 + 4 + 8, 2 + 18),  # fused_sgd_update.step_remainders
    "remainder eager": Variant("O5", REMAINDER, False, 6 + 4 + 8),
    "O7 fused": Variant("O7", {}, True, 4 + 2 + 8, 2 + 4 + 2 + 8),
    "O7 eager": Variant("O7", {}, False, 4 + 2 + 8),
    "O7 bf16 state fused": Variant("O7", BF16_STATE, True, 4 + 2 + 4, 2 + 4 + 2 + 4),
    "O7 bf16 state eager": Variant("O7", BF16_STATE, False, 4 + 2 + 4),
    "O8": Variant("O8", {}, True, 4 + 2 + 2),
    "O8 eager": Variant("O8", {}, False, 4 + 2 + 2),
    "torch SGD fused fp32": Variant(None, {}, True, 8 + 4 + 8, 8 + 4 + 8, make=partial(torch.optim.SGD, fused=True, **peers.SGD)),
    "torch SGD foreach fp32": Variant(None, {}, True, 8 + 4 + 8, make=partial(torch.optim.SGD, foreach=True, **peers.SGD)),
    **_peers(peers.SGD_PEERS, {"plain bf16 SGD (control)": 4 + 2 + 4, "bnb SGD8bit": 4 + 2 + 2, "optimi SGD Kahan": 4 + 2 + 4 + 4}),
}
TABLES = {"AdamW": ADAMW, "SGD": SGD}
EAGER = {"O5": "O5 eager", "remainder": "remainder eager", "O7 fused": "O7 eager",
         "O7 bf16 state fused": "O7 bf16 state eager", "O8": "O8 eager"}  # each fused level row: its eager row


def why_not(v: Variant) -> Optional[str]:
    """Why row ``v`` cannot run here (a level this ampkit lacks, a library that does not import), or None."""
    if v.level is not None and v.level not in OPT_LEVELS:
        return f"this ampkit has no level {v.level}"
    return peers.unavailable(v.needs)


def build(optimizer: str, v: Variant, model, device):
    """``model`` (seeded by the caller) on ``device`` and row ``v``'s optimizer of kind ``optimizer`` over it."""
    model = model.to(device=device, dtype=v.dtype)
    if v.level is None:
        return model, v.make(model.parameters(), lr=LR[optimizer])
    opt = BASE[optimizer](model.parameters(), lr=LR[optimizer])
    return ampkit.initialize(model, opt, opt_level=v.level, verbosity=0, **v.overrides)


def state_bytes(v: Variant, model, opt) -> float:
    """Persistent bytes per parameter (weights, masters or remainders, optimizer state; the model's buffers
    apart): ``ampkit.footprint.persistent_bytes`` for a level, ``peers.state_bytes`` for the others."""
    mem = persistent_bytes([model], [opt]) if v.level else peers.state_bytes(model, getattr(opt, "opt", opt))
    return (mem["total"] - mem["buffers"]) / mem["params"]
