"""A deterministic little training run for the resume tests in ``test_checkpoint.py``.

Imported, it gives the uninterrupted run, the first part and its checkpoint (the documented
recipe: ``{"model": model.state_dict(), "optimizer": optimizer.state_dict(), "amp":
ampkit.state_dict()}``) in-process. Run as a script,

    python _resume_worker.py LEVEL CHECKPOINT OUT START STOP

it is the *new process* of the recipe: it builds a fresh model (different random weights),
initializes it the same way, loads the three parts, trains steps START..STOP-1 and writes a
snapshot of everything to OUT. Everything a step sees (its batch, its injected overflow)
is a function of the step number alone, so a resumed run repeats the original exactly.
"""
import copy
import os
import sys

import torch
from torch import nn

import ampkit

OVERFLOW_STEPS = {1}  # an inf gradient at step 1: the scaler state (and the skip) matter
BUILD_SEED = 1234


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(5, 8)
        self.bn = nn.BatchNorm1d(8)
        self.fc2 = nn.Linear(8, 2)

    def forward(self, x):
        return self.fc2(torch.tanh(self.bn(self.fc1(x))))


def build(level, seed=BUILD_SEED):
    torch.manual_seed(seed)
    model = Net()
    # eps=1e-3 is representable in float16 (O3 steps Adam on half parameters).
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-3, weight_decay=0.05)
    model, opt = ampkit.initialize(model, opt, opt_level=level, verbosity=0)
    if opt._ampkit.run.scalers[0].dynamic:
        # 2**16 overflows float16 on this tiny model's first steps; start lower (dynamic still).
        ampkit.load_state_dict({"loss_scaler0": {"loss_scale": 256.0, "unskipped": 0}}, optimizer=opt)
    return model, opt


def batch(step):
    g = torch.Generator().manual_seed(7000 + step)
    return torch.randn(6, 5, generator=g), torch.randn(6, 2, generator=g)


def train(model, opt, start, stop):
    for step in range(start, stop):
        x, y = batch(step)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        if step in OVERFLOW_STEPS:
            loss = loss * float("inf")
        with ampkit.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()


def checkpoint(model, opt):
    """The documented recipe."""
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "amp": ampkit.state_dict(optimizer=opt)}


def resume(level, ckpt):
    model, opt = build(level, seed=BUILD_SEED + 1)  # a fresh model: different weights
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["optimizer"])
    ampkit.load_state_dict(ckpt["amp"], optimizer=opt)
    return model, opt


def snapshot(model, opt):
    """Everything that must match bit for bit (cloned: the state dict aliases the masters)."""
    snap = copy.deepcopy({
        "model": model.state_dict(),
        "params": [p.detach() for p in model.parameters()],
        "buffers": [b.detach() for b in model.buffers()],
        "masters": [m.detach() for m in ampkit.master_params(opt)],
        "optimizer": opt.state_dict(),
        "amp": [s.state_dict() for s in opt._ampkit.run.scalers],
    })
    with torch.no_grad():
        snap["out"] = model.eval()(batch(99)[0])
    model.train()
    return snap


def main(argv):
    level, ckpt_path, out_path, start, stop = argv[0], argv[1], argv[2], int(argv[3]), int(argv[4])
    torch.set_num_threads(1)
    ckpt = torch.load(ckpt_path, weights_only=True)
    model, opt = resume(level, ckpt)
    train(model, opt, start, stop)
    snap = snapshot(model, opt)
    snap["pid"] = os.getpid()
    torch.save(snap, out_path)


if __name__ == "__main__":
    main(sys.argv[1:])
