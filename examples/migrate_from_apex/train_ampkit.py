"""An Apex-era training script, and (train_ampkit.py) the same script after apex_to_ampkit.diff.

The diff is the two import lines. train_apex.py needs NVIDIA Apex (and so CUDA);
train_ampkit.py runs wherever PyTorch does:

    python train_ampkit.py --opt-level O1 --steps 100
"""
import argparse

import torch
import torch.nn.functional as F
from torch import nn

import ampkit as amp
from ampkit.normalization import FusedLayerNorm


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--opt-level", default="O1")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--checkpoint", default="checkpoint.pt")
    args = parser.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    teacher = torch.randn(64, 8, device=device) / 8
    model = nn.Sequential(nn.Linear(64, 256), FusedLayerNorm(256), nn.GELU(), nn.Linear(256, 8)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level, loss_scale="dynamic")

    for step in range(args.steps):
        x = torch.randn(128, 64, device=device)
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), x @ teacher)
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), 1.0)
        optimizer.step()
        if step % 20 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss.item():.4f}")

    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "amp": amp.state_dict()},
               args.checkpoint)


if __name__ == "__main__":
    main()
