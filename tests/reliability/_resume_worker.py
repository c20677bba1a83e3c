"""A deterministic little training run that checkpoints as it goes (used by test_resume.py).

Run as a script it trains from step 0, saves ``ampkit.checkpoint`` files every ``--every``
steps and prints ``STEP n`` / ``CKPT n`` lines, so a parent can SIGKILL it at a step of
its choosing. Imported, the same functions give the uninterrupted reference and the
resumed run in-process. Everything a step sees (its batch, its injected overflow) is a
function of the step number alone, so a resumed run repeats the original exactly.
"""
import argparse
import os
import signal
import sys
import time

import torch
from torch import nn

import ampkit
from ampkit import checkpoint
from ampkit._run.registry import current as current_run

OPTIMIZERS = {"O0": "sgd", "O2": "adamw", "O5": "adamw", "O8": "adamw"}
OVERFLOW_EVERY = 7  # steps with step % 7 == 3 get an inf gradient: the scaler state matters


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(5, 8)
        self.fc2 = nn.Linear(8, 2)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def build(level: str):
    torch.manual_seed(1234)
    model = Net()
    if OPTIMIZERS[level] == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    model, opt = ampkit.initialize(model, opt, opt_level=level, verbosity=0)
    for s in current_run("resume worker").scalers:
        s.growth_interval = 4  # not part of the saved state: set the same way in every process
    state = {"poison": False}

    def hook(grad):
        if not state["poison"]:
            return None
        grad = grad.clone()
        grad.view(-1)[0] = float("inf")
        return grad

    model.fc1.weight.register_hook(hook)
    return model, opt, state


def batch(step: int):
    g = torch.Generator().manual_seed(10_000 + step)
    x = torch.randn(12, 5, generator=g)
    return x, torch.sin(x[:, :2]) + 0.1 * torch.randn(12, 2, generator=g)


def train(model, opt, poison, start: int, end: int, on_step=None):
    """Steps ``start+1 .. end`` (1-based); returns each step's loss as a Python float."""
    losses = []
    for step in range(start + 1, end + 1):
        x, y = batch(step)
        loss = nn.functional.mse_loss(model(x), y)
        poison["poison"] = step % OVERFLOW_EVERY == 3
        with ampkit.scale_loss(loss, opt) as scaled:
            scaled.backward()
        poison["poison"] = False
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if on_step is not None:
            on_step(step)
    return losses


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--level", required=True)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--total", type=int, required=True)
    ap.add_argument("--every", type=int, required=True)
    ap.add_argument("--die-in-save-at", type=int, default=None,
                    help="SIGKILL itself inside the save at this step, after the temporary file is "
                         "written and before it replaces the checkpoint")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model, opt, poison = build(args.level)
    out = sys.stdout

    def on_step(step):
        if step % args.every == 0 and step < args.total:
            if step == args.die_in_save_at:
                os.replace = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
            checkpoint.save(args.ckpt, model, opt, extra={"step": step})
            out.write(f"CKPT {step}\n")
        out.write(f"STEP {step}\n")
        out.flush()

    train(model, opt, poison, 0, args.total, on_step)
    out.write("DONE\n")
    out.flush()
    time.sleep(120)  # wait to be killed: the parent always ends this run with SIGKILL


if __name__ == "__main__":
    main()
