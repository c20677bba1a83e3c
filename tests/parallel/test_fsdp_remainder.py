"""master_weights="remainder" on FSDP2 (2 gloo ranks): each rank's masters, held as bf16 shards
plus int16 remainder shards and their side tables, follow O5's arithmetic bit for bit.

On each rank a shadow keeps fp32 master shards (O5's masters) and steps them on the same local
gradient shards as O5 would: in the fused AdamW of ``_kernels/fused_masters.py``, and (the same
launch, a second run) with ``AMPKIT_FUSED=0`` in a plain ``torch.optim.AdamW``. At every step the sharded run's bf16 weights are the shadow's
rounding and its masters the shadow's exactly, across a skipped step (an inf on one rank) and a
DCP checkpoint loaded into a fresh model in the same processes. The model is large enough
(264k parameters) that the side tables are in use at about every step.
"""
import pytest
import torch
from torch import nn

import ampkit
from ampkit._kernels.remainder import master, side_table
from ampkit.parallel import load_sharded, save_sharded

from ._launch import run

pytestmark = pytest.mark.slow

STEPS, POISON_STEP, SAVE_AT = 30, 7, 15


def _build(seed):
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(64, 2048), nn.Tanh(), nn.Linear(2048, 64))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    return ampkit.initialize(net, opt, opt_level="O5", master_weights="remainder", fsdp=True, verbosity=0)


def _masters(model):
    """This rank's bf16 weight shards and the fp32 masters their (weight, remainder) pairs hold."""
    weights = [p.detach().to_local() for p in model.parameters()]
    return weights, [master(w, model._ampkit.remainders[p]) for w, p in zip(weights, model.parameters())]


def _exact(model, shadow) -> bool:
    weights, masters = _masters(model)
    return all(torch.equal(w.view(torch.int16), s.bfloat16().view(torch.int16)) and
               torch.equal(m.view(torch.int32), s.view(torch.int32)) for w, m, s in zip(weights, masters, shadow))


class FusedShadow:
    """O5's fused AdamW on the shadow masters (``_kernels/fused_masters.py``, AdamW's defaults, lr 1e-3)."""

    def __init__(self, params):
        self.params, self.steps = params, 0
        self.state = [(torch.zeros_like(p), torch.zeros_like(p)) for p in params]

    def step(self):
        from ampkit._kernels import native
        from ampkit._kernels.fused_adamw import Hyper
        from ampkit._kernels.fused_masters import step_master_
        self.steps += 1
        for p, (m, v) in zip(self.params, self.state):
            step_master_(p, p.grad, m, v, Hyper(1e-3, 0.9, 0.999, 1e-8, 1e-2, True, False, float(self.steps)),
                         lib=native.library())


def _worker(rank, world_size, checkpoint_dir):
    import os
    out = {}
    for fused in ("1", "0"):
        os.environ["AMPKIT_FUSED"] = fused
        out[fused] = _run(rank, os.path.join(checkpoint_dir, fused), fused == "1")
    return out


def _run(rank, checkpoint_dir, fused):
    model, opt = _build(seed=rank)  # every rank starts from rank 0's fp32 weights
    shadow = [m.clone() for m in _masters(model)[1]]
    shadow_opt = FusedShadow(shadow) if fused else torch.optim.AdamW(shadow, lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    out = {"exact": [_exact(model, shadow)], "skipped": [], "listed": []}
    for step in range(STEPS):
        if step == SAVE_AT:  # a DCP checkpoint, loaded into a model built from other weights
            save_sharded(checkpoint_dir, model, opt)
            model, opt = _build(seed=100 + rank)
            load_sharded(checkpoint_dir, model, opt)
            out["exact_after_load"] = _exact(model, shadow)
        x, y = torch.randn(8, 64, generator=g), torch.randn(8, 64, generator=g)
        opt.zero_grad()
        loss = (model(x).float() - y).pow(2).mean()
        with ampkit.scale_loss(loss, opt) as scaled:
            scaled.backward()
            if step == POISON_STEP and rank == 1:
                with torch.no_grad():
                    model[0].weight.grad.to_local().view(-1)[0] = float("inf")
        grads = [p.grad.to_local().float() for p in model.parameters()]  # what the step is given
        opt.step()
        skipped = ampkit.step_was_skipped(opt)
        if not skipped:
            for s, gr in zip(shadow, grads):
                s.grad = gr
            shadow_opt.step()
        out["skipped"].append(skipped)
        out["exact"].append(_exact(model, shadow))
        out["listed"].append(sum(side_table(model._ampkit.remainders[p]).numel() for p in model.parameters()))
    return out


def test_remainder_shards_follow_o5_bit_for_bit_with_a_skipped_step_and_a_checkpoint(tmp_path):
    ranks = [r[fused] for r in run(_worker, 2, str(tmp_path / "dcp"), timeout=900, pg_timeout=600) for fused in r]
    assert len(ranks) == 4
    for rank in ranks:
        assert rank["exact"] == [True] * (STEPS + 1) and rank["exact_after_load"] is True
        assert rank["skipped"] == [step == POISON_STEP for step in range(STEPS)]
    assert sum(sum(rank["listed"]) for rank in ranks) > 0  # the side tables were in use
