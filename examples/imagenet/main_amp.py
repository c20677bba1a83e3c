"""Apex's classic examples/imagenet/main_amp.py on ampkit: a ResNet-style CNN on synthetic images.

    python examples/imagenet/main_amp.py --opt-level O5 --steps 100 --checkpoint ckpt.pt
    python examples/imagenet/main_amp.py --opt-level O5 --steps 200 --resume ckpt.pt --checkpoint ckpt.pt

The data is generated in-process and depends only on the step number, so a resumed run
sees exactly the batches an uninterrupted run would (on CPU it ends with the same loss).
"""
import argparse
import os

import torch
import torch.nn.functional as F
from torch import nn

import ampkit


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet(nn.Module):
    """ResNet-18's layout (2 blocks per stage), narrower and with three stages."""

    def __init__(self, width: int, classes: int):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 2, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        blocks, c = [], width
        for i, stride in enumerate((1, 2, 2)):
            blocks += [BasicBlock(c, width * 2**i, stride), BasicBlock(width * 2**i, width * 2**i, 1)]
            c = width * 2**i
        self.layers = nn.Sequential(*blocks)
        self.fc = nn.Linear(c, classes)

    def forward(self, x):
        return self.fc(self.layers(self.stem(x)).mean((2, 3)))


def synthetic_batch(step: int, args):
    """Batch ``step`` of a fixed synthetic task: a low-frequency template per class plus noise."""
    templates = F.interpolate(torch.randn(args.classes, 3, 4, 4, generator=torch.Generator().manual_seed(args.seed)),
                              size=args.image_size, mode="bilinear", align_corners=False)
    g = torch.Generator().manual_seed(args.seed + 1 + step)
    target = torch.randint(args.classes, (args.batch_size,), generator=g)
    images = templates[target] + torch.randn(args.batch_size, 3, args.image_size, args.image_size, generator=g)
    return images, target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--opt-level", default="O5", choices=sorted(ampkit.OPT_LEVELS))
    parser.add_argument("--keep-batchnorm-fp32", default=None, help='"True" or "False" (default: the level\'s)')
    parser.add_argument("--loss-scale", default=None, help='"dynamic" or a number (default: the level\'s)')
    parser.add_argument("--steps", type=int, default=100, help="train until this step")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--print-freq", type=int, default=10)
    parser.add_argument("--resume", metavar="PATH", help="checkpoint to resume from")
    parser.add_argument("--checkpoint", metavar="PATH", help="where to save a checkpoint at the end")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(args.seed)
    model = ResNet(args.width, args.classes).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    model, optimizer = ampkit.initialize(model, optimizer, opt_level=args.opt_level,
                                         keep_batchnorm_fp32=args.keep_batchnorm_fp32, loss_scale=args.loss_scale)

    start = 0
    if args.resume:  # after initialize, as in Apex: model, optimizer and loss scalers
        ckpt = torch.load(args.resume, map_location=device, weights_only=True)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        ampkit.load_state_dict(ckpt["amp"])
        start = ckpt["step"]
        print(f"resumed from {args.resume} at step {start}")

    model.train()
    for step in range(start, args.steps):
        images, target = (t.to(device) for t in synthetic_batch(step, args))
        output = model(images)
        loss = F.cross_entropy(output, target)
        optimizer.zero_grad()
        with ampkit.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        if step % args.print_freq == 0 or step == args.steps - 1:
            top1 = (output.argmax(1) == target).float().mean().item() * 100
            scale = ampkit.state_dict()["loss_scaler0"]["loss_scale"]
            print(f"step {step:5d}  loss {loss.item():.4f}  prec@1 {top1:5.1f}  loss scale {scale:g}")

    if args.steps > start:
        print(f"final loss {loss.item()!r}")
    if args.checkpoint:
        tmp = args.checkpoint + ".tmp"
        torch.save({"step": max(start, args.steps), "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(), "amp": ampkit.state_dict()}, tmp)
        os.replace(tmp, args.checkpoint)  # never leave a half-written checkpoint behind
        print(f"saved {args.checkpoint}")


if __name__ == "__main__":
    main()
