"""accelerate at any ampkit level: python accelerate_train.py --opt-level O8 --steps 50"""
import argparse

import torch
from torch import nn

import ampkit
from ampkit.integrations.accelerate import AmpkitAccelerator


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--opt-level", default="O5")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--state-dir", default="accelerate_state")
    args = parser.parse_args()
    torch.manual_seed(0)
    accelerator = AmpkitAccelerator(cpu=True, gradient_accumulation_steps=2)  # mixed_precision="no"
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=1000)
    model, optimizer = ampkit.initialize(model, optimizer, opt_level=args.opt_level)  # before prepare
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    for step in range(args.steps):
        x = torch.randn(32, 32)
        y = x[:, :1] * 2 - x[:, 1:2]
        with accelerator.accumulate(model):
            loss = nn.functional.mse_loss(model(x).float(), y)
            accelerator.backward(loss)  # inside ampkit.scale_loss
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)  # clips the fp32 masters
            optimizer.step()
            scheduler.step()  # holds when ampkit skipped the step
            optimizer.zero_grad()
        if step in (0, args.steps - 1):
            print(f"step {step} loss {loss.item():.4f} skipped {accelerator.optimizer_step_was_skipped}")
    accelerator.save_state(args.state_dir)  # the loss scalers too
    print(f"saved {args.state_dir}")


if __name__ == "__main__":
    main()
