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


def test_o8_adamw_stays_under_4_1_bytes_per_parameter():
    """bf16 weights, and AdamW's two moments as one byte per element plus a float32 scale per
    block of 256: 2 + 2 * (1 + 4/256) = 4.03 bytes, and the step counters."""
    from ampkit._kernels.blockquant import num_blocks

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    model, opt = ampkit.initialize(model, torch.optim.AdamW(model.parameters()), opt_level="O8", verbosity=0)
    loss = F.mse_loss(model(torch.randn(8, 64)), torch.randn(8, 64))
    with ampkit.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()
    opt.zero_grad()
    params = list(model.parameters())
    n, blocks = sum(p.numel() for p in params), sum(num_blocks(p.numel()) for p in params)
    got = persistent_bytes([model], [opt])
    assert (got["params"], got["weights"], got["masters"], got["grad_buffers"]) == (n, 2 * n, 0, 0)
    assert got["optimizer_state"] == 2 * n + 2 * 4 * blocks + 4 * len(params)  # codes, scales, steps
    assert bytes_per_param([model], [opt]) <= 4.1


def test_one_model_and_one_optimizer_count_as_lists_and_bad_arguments_are_named():
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    assert persistent_bytes(model, opt) == persistent_bytes([model], [opt]) == persistent_bytes((model,), (opt,))
    assert persistent_bytes(model, opt)["weights"] == 4 * (4 * 3 + 3)
    with pytest.raises(TypeError, match=r"^persistent_bytes\(models=...\): expected an nn.Module or a list of them, got "
                                        r"SGD \(the arguments are models, optimizers: swapped\?\)\.$"):
        persistent_bytes([opt], [model])
    with pytest.raises(TypeError, match=r"^persistent_bytes\(optimizers=...\): expected an optimizer or a list of them, "
                                        r"got Linear \(the arguments are models, optimizers: swapped\?\)\.$"):
        persistent_bytes([model], model)
    with pytest.raises(TypeError, match=r"^bytes_per_param\(models=...\): expected an nn.Module or a list of them, got str\.$"):
        bytes_per_param("model", [opt])
    with pytest.raises(ValueError, match=r"^bytes_per_param\(models=...\): the models hold no parameters"):
        bytes_per_param([nn.ReLU()], [])
    assert persistent_bytes([nn.ReLU()], [])["params"] == 0
