"""End to end: fine-tune a head on a frozen BatchNorm backbone (eval mode) at every opt level."""
import pytest
import torch
from torch import nn

import ampkit
from ampkit._model import batchnorm

HALF = {"O1": torch.float16, "O2": torch.float16, "O3": torch.float16, "O4": torch.bfloat16, "O5": torch.bfloat16}
# BatchNorm dtype after initialize, and the dtype of the activations it receives.
BN_DTYPE = {"O0": torch.float32, "O1": torch.float32, "O2": torch.float32, "O3": torch.float16,
            "O4": torch.float32, "O5": torch.float32}
BN_INPUT = {"O0": torch.float32, "O1": torch.float16, "O2": torch.float16, "O3": torch.float16,
            "O4": torch.bfloat16, "O5": torch.bfloat16}


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
            nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        )
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.backbone(x))


def pretrained_frozen_net():
    model = ConvNet()
    with torch.no_grad():
        for m in model.backbone:
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.2, 0.2)
                m.running_var.uniform_(0.5, 1.5)
                m.num_batches_tracked.fill_(100)
    model.backbone.requires_grad_(False).eval()
    return model


@pytest.mark.parametrize("level,path", [(lvl, "native") for lvl in BN_DTYPE] + [("O2", "cast"), ("O5", "cast")])
def test_frozen_batchnorm_finetune(level, path, monkeypatch):
    if path == "cast":  # the path taken on device types without mixed-dtype BatchNorm kernels
        monkeypatch.setattr(batchnorm, "NATIVE_MIXED_DEVICES", frozenset())
    model = pretrained_frozen_net()
    opt = torch.optim.SGD(model.head.parameters(), lr=0.5, momentum=0.9)
    model, opt = ampkit.initialize(model, opt, opt_level=level, verbosity=0)
    bns = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    frozen = [{k: v.clone() for k, v in bn.named_buffers()} for bn in bns]
    seen = []
    for bn in bns:
        assert bn.weight.dtype == BN_DTYPE[level] and not bn.training
        bn.register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype), prepend=True)
        bn.register_forward_hook(lambda m, args, out: seen.append(out.dtype))

    target = torch.arange(16) % 4
    x = torch.randn(16, 3, 8, 8) + 2 * torch.randn(4, 3)[target, :, None, None]  # learnable classes
    losses = []
    for _ in range(8):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), target)
        with ampkit.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        losses.append(loss.item())

    assert set(seen) == {BN_INPUT[level]}  # half activations met the (float32) BatchNorm: output dtype = input dtype
    for bn, before in zip(bns, frozen):
        for name, value in bn.named_buffers():
            assert value.dtype == before[name].dtype and torch.equal(value, before[name]), name
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.9 * losses[0], losses
