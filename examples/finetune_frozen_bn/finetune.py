"""Fine-tune a head on a frozen BatchNorm backbone at O2/O5: the eval-mode BatchNorm case.

    python examples/finetune_frozen_bn/finetune.py --opt-level O5 --steps 100

The backbone is frozen (``requires_grad=False``) and kept in ``eval()`` so its BatchNorm
layers use, and never update, their running statistics. Under Apex's O2 this crashed:
BatchNorm kept in float32 received half input in eval mode. With ampkit the backbone's
convs run in half, its BatchNorm stays float32 and accepts the half input in eval mode.
"""
import argparse

import torch
import torch.nn.functional as F
from torch import nn

import ampkit


class FineTuner(nn.Module):
    def __init__(self, classes: int):
        super().__init__()
        layers, c_in = [], 3
        for c_out, stride in ((16, 1), (32, 2), (64, 2)):
            layers += [nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU()]
            c_in = c_out
        self.backbone = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(c_in, classes)

    def train(self, mode: bool = True):
        """Train the head only: the frozen backbone stays in eval mode."""
        super().train(mode)
        self.backbone.eval()
        return self

    def forward(self, x):
        return self.head(self.backbone(x))


def batch(g: torch.Generator, templates: torch.Tensor, n: int):
    y = torch.randint(len(templates), (n,), generator=g)
    return templates[y] + 0.5 * torch.randn(n, *templates.shape[1:], generator=g), y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--opt-level", default="O5", choices=["O2", "O5"])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=32)
    args = parser.parse_args()

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    templates = F.interpolate(torch.randn(10, 3, 4, 4, generator=g), size=args.image_size, mode="bilinear")
    model = FineTuner(classes=10)

    # Stand-in for loading a pretrained backbone: give its BatchNorm layers running statistics.
    with torch.no_grad():
        model.backbone.train()
        for _ in range(10):
            model.backbone(batch(g, templates, args.batch_size)[0])
    for p in model.backbone.parameters():
        p.requires_grad_(False)
    stats = {k: v.clone() for k, v in model.backbone.state_dict().items() if "running" in k}

    optimizer = torch.optim.SGD(model.head.parameters(), lr=0.5, momentum=0.9)
    model, optimizer = ampkit.initialize(model, optimizer, opt_level=args.opt_level)
    model.train()  # the head trains; the backbone stays in eval mode
    bn = model.backbone[1]
    print(f"backbone conv weights: {model.backbone[0].weight.dtype}, BatchNorm: {bn.weight.dtype}, "
          f"BatchNorm in training mode: {bn.training}")

    for step in range(args.steps):
        x, y = batch(g, templates, args.batch_size)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        with ampkit.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        if step % 20 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss.item():.4f}")

    after = {k: v for k, v in model.backbone.state_dict().items() if k in stats}
    print("BatchNorm running statistics unchanged:", all(torch.equal(stats[k], after[k]) for k in stats))


if __name__ == "__main__":
    main()
