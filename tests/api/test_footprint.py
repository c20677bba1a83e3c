"""Persistent bytes, measured from the storages: weights, masters, optimizer state."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampkit
from ampkit.footprint import bytes_per_param, persistent_bytes


@pytest.mark.parametrize("level, overrides, weights, masters, state", [
    ("O0", {}, 4, 0, 8),
    ("O5", {}, 2, 4, 8),
    ("O7", {}, 2, 0, 8),
    ("O7", dict(optimizer_state_dtype=torch.bfloat16), 2, 0, 4),
])
def test_adamw_bytes_per_parameter(level, overrides, weights, masters, state):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    model, opt = ampkit.initialize(model, torch.optim.AdamW(model.parameters()), opt_level=level, verbosity=0, **overrides)
    loss = F.mse_loss(model(torch.randn(8, 16)), torch.randn(8, 4))
    with ampkit.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()
    opt.zero_grad()
    n, tensors = 16 * 32 + 32 + 32 * 4 + 4, 4
    got = persistent_bytes([model], [opt])
    assert got["params"] == n and got["buffers"] == 0 and got["grad_buffers"] == 0
    assert (got["weights"], got["masters"]) == (weights * n, masters * n)
    assert got["optimizer_state"] == state * n + 4 * tensors  # exp_avg and exp_avg_sq, and a float32 step per tensor
    assert got["optimizer_scalars"] == 4 * tensors
    assert bytes_per_param([model], [opt]) == pytest.approx(weights + masters + state, abs=0.05)
