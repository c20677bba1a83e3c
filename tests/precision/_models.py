"""Small models whose precision failures are known, and a loss and batches to train them with."""
import torch
import torch.nn.functional as F
from torch import nn

import ampkit

WIDTH, CLASSES, BATCH = 32, 4, 16


def batches(n: int = 2, seed: int = 1, dead: bool = False):
    """``n`` (inputs, labels) batches; ``dead``: input feature 0 is always zero."""
    g = torch.Generator().manual_seed(seed)
    out = [(torch.randn(BATCH, WIDTH, generator=g), torch.randint(CLASSES, (BATCH,), generator=g)) for _ in range(n)]
    for x, _ in out:
        x[:, 0] = 0.0 if dead else x[:, 0]
    return out


def loss_fn(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def adam(model, lr: float = 1e-2, slow=(), slow_lr: float = 1e-5):
    """Adam at ``lr``, and at ``slow_lr`` for the parameters named in ``slow``."""
    fast = [p for n, p in model.named_parameters() if n not in slow]
    groups = [{"params": fast}] + ([{"params": [p for n, p in model.named_parameters() if n in slow], "lr": slow_lr}] if slow else [])
    return torch.optim.Adam(groups, lr=lr)


class Net(nn.Module):
    """inp -> relu -> mid -> norm -> head; each ground-truth model breaks one part."""

    def __init__(self, mid_bias: bool = True):
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.act = nn.ReLU()
        self.mid = nn.Linear(WIDTH, WIDTH, bias=mid_bias)
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, CLASSES)
        self.mid_fp32 = False  # run mid in fp32 under autocast (what keep_fp32 recommends)

    def forward(self, x):
        h = self.act(self.inp(x))
        if self.mid_fp32:
            with ampkit.disable_casts():
                h = self.mid(h.float())
        else:
            h = self.mid(h)
        return self.head(self.norm(h))


def overflow_net() -> Net:
    """``mid`` outputs about 1e5: over float16's range, far inside bfloat16's."""
    torch.manual_seed(0)
    net = Net()
    with torch.no_grad():
        net.mid.weight.mul_(1e6)
    return net


def stalled_net() -> Net:
    """``mid.weight`` holds values of 1 to 10, trained at lr 1e-5: below half a bf16 (and fp16) ulp."""
    torch.manual_seed(0)
    net = Net(mid_bias=False)
    with torch.no_grad():
        w = torch.empty_like(net.mid.weight).uniform_(1, 10)
        net.mid.weight.copy_(w * torch.randint(0, 2, w.shape).mul(2).sub(1))
    return net


class OutlierNet(nn.Module):
    """``first.weight`` holds one element of 3e4 on input feature 0, which the data leaves at zero
    (see :func:`batches`' ``dead``): it never moves or shows in the output, but the fp8 scale it
    sets flushes or coarsens every other weight of the layer. ``second`` is an ordinary fp8 layer."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(WIDTH, WIDTH)
        self.act = nn.ReLU()
        self.second = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, CLASSES)
        with torch.no_grad():
            self.first.weight[0, 0] = 3e4

    def forward(self, x):
        return self.head(self.norm(self.second(self.act(self.first(x)))))


class Log(nn.Module):
    def forward(self, x):
        return torch.log(x)


class NanNet(nn.Module):
    """``bad`` takes the log of a Linear's output, negative half the time: NaN in fp32."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.bad = Log()
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x):
        return self.head(self.bad(self.inp(x)))
