"""Optimizer wrappers (LARC and the like) whose methods have their own signatures."""
import torch
from torch import nn

import ampkit


class VendoredLARC:
    """Apex's LARC as many repositories vendor it: ``zero_grad()`` takes no argument."""

    def __init__(self, optimizer):
        self.optim = optimizer

    @property
    def param_groups(self):
        return self.optim.param_groups

    @property
    def state(self):
        return self.optim.state

    def zero_grad(self):
        self.optim.zero_grad()

    def add_param_group(self, group):
        self.optim.add_param_group(group)

    def step(self):
        return self.optim.step()


def test_a_wrapper_whose_zero_grad_takes_no_argument_trains():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    opt = VendoredLARC(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    model, opt = ampkit.initialize(model, opt, opt_level="O2", verbosity=0)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    losses = []
    for _ in range(5):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        with ampkit.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert all(p.grad is None for p in model.parameters())
    assert all(p.grad is None for p in ampkit.master_params(opt))
