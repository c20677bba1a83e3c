"""Fabric at any ampkit level, with a checkpoint: python fabric_train.py --opt-level O7 --steps 50"""
import argparse

import lightning as L
import torch
from torch import nn

import ampkit


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--opt-level", default="O5")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--checkpoint", default="fabric.ckpt")
    args = parser.parse_args()
    torch.manual_seed(0)
    fabric = L.Fabric(accelerator="cpu", devices=1)  # precision stays "32-true": ampkit does the mixed precision
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = ampkit.initialize(model, optimizer, opt_level=args.opt_level)  # before fabric.setup
    model, optimizer = fabric.setup(model, optimizer)
    for step in range(args.steps):
        x = torch.randn(32, 32)
        y = x[:, :1] * 2 - x[:, 1:2]
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x).float(), y)
        with ampkit.scale_loss(loss, optimizer) as scaled_loss:
            fabric.backward(scaled_loss)
        # clips the fp32 masters; the gradients of a step ampkit skips (an overflow) are not finite
        fabric.clip_gradients(model, optimizer, max_norm=1.0, error_if_nonfinite=False)
        optimizer.step()
        if step in (0, args.steps - 1):
            print(f"step {step} loss {loss.item():.4f}")
    fabric.save(args.checkpoint, {"model": model, "optimizer": optimizer, "amp": ampkit})
    print(f"saved {args.checkpoint}")


if __name__ == "__main__":
    main()
