"""The README snippet, complete: a small classifier trained with ampkit on synthetic data.

    python examples/simple/train.py --opt-level O5 --steps 200
"""
import argparse

import torch
import torch.nn.functional as F
from torch import nn

import ampkit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--opt-level", default="O5", choices=sorted(ampkit.OPT_LEVELS))
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()

    torch.manual_seed(0)
    teacher = torch.randn(32, 4)  # the labels are a fixed random function of the inputs
    model = nn.Sequential(nn.Linear(32, 128), nn.BatchNorm1d(128), nn.ReLU(), nn.Linear(128, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    model, optimizer = ampkit.initialize(model, optimizer, opt_level=args.opt_level)

    for step in range(args.steps):
        x = torch.randn(args.batch_size, 32)
        y = (x @ teacher).argmax(1)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)  # inputs are cast for you; outputs come back float32
        with ampkit.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()  # skipped (weights untouched) if the gradients overflowed
        if step % 20 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
