"""What the framework tests share: a seeded model, its batches, and the hand-written ampkit loop."""
import torch
from torch import nn

import ampkit

LEVELS = ["O0", "O1", "O2", "O3", "O4", "O5", "O6", "O7", "O8", "auto", "remainder"]


def level_options(level: str) -> dict:
    """``initialize``'s keywords for a test level ("remainder": O5 with remainder masters)."""
    if level == "O6":
        __import__("pytest").importorskip("torchao", reason="O6 needs torchao (ampkit[fp8])")
    if level == "remainder":
        return {"opt_level": "O5", "master_weights": "remainder", "verbosity": 0}
    return {"opt_level": level, "verbosity": 0}


def make_net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))


def make_optimizer(params) -> torch.optim.Optimizer:
    """Adam with an eps that float16 can hold (1e-8 flushes to zero there: pure fp16 (O3) would divide by 0)."""
    return torch.optim.Adam(params, lr=1e-2, eps=1e-4)


def make_batches(n: int, seed: int = 1, bad=()) -> list:
    """``n`` (x, y) batches; those indexed in ``bad`` hold an input that overflows half precision."""
    g = torch.Generator().manual_seed(seed)
    batches = [(torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)) for _ in range(n)]
    for i in bad:
        batches[i][0][0, 0] = float("inf")
    return batches


def loss_of(out, y):
    return nn.functional.mse_loss(out.float(), y)


def reference(level: str, batches, clip=None, accumulate: int = 1, schedule=False, **extra):
    """The hand-written ampkit loop: the weights (as float32) and the learning rates after each step."""
    net = make_net()
    opt = make_optimizer(net.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) if schedule else None
    net, opt = ampkit.initialize(net, opt, **level_options(level), **extra)
    lrs = []
    opt.zero_grad()
    for i, (x, y) in enumerate(batches):
        loss = loss_of(net(x), y) / accumulate
        with ampkit.scale_loss(loss, opt) as scaled:
            scaled.backward()
        if (i + 1) % accumulate:
            continue
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(ampkit.master_params(opt), clip)
        opt.step()
        opt.zero_grad()
        if sched is not None and not ampkit.step_was_skipped(opt):
            sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    return weights(net), lrs


def weights(net) -> list:
    return [t.detach().float().clone() for t in net.state_dict().values()]


def same(a, b) -> bool:
    """Equal tensor for tensor, and finite (a comparison of diverged weights would prove little)."""
    return len(a) == len(b) and all(torch.equal(x, y) and bool(torch.isfinite(x).all()) for x, y in zip(a, b))
