"""A tiny sharded run for the multi-process checkpoint tests: a few small MLP layers with
AdamW, initialized with ``fsdp=True``; one global batch of 12 samples per step, cut into one
equal part per rank at 1, 2, 3 and 4 ranks; snapshots of the whole run as rank 0 sees it.

The blocks are 8 wide, 16 at O6: torchao's Float8Linear takes Linear layers whose feature
counts are multiples of 16, so there the two blocks run fp8 (the first and last Linear stay
bf16, as ``initialize`` decides)."""
import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import ampkit
from ampkit.parallel import full_state_dict

BATCH = 12
LEVELS = {"O2": {"opt_level": "O2"}, "O5": {"opt_level": "O5"}, "O7": {"opt_level": "O7"}, "O8": {"opt_level": "O8"},
          "remainder": {"opt_level": "O5", "master_weights": "remainder"}}
ALL_LEVELS = {**{level: {"opt_level": level} for level in ("O0", "O1", "O3", "O4")}, **LEVELS}
# every level, and O7 with bf16 optimizer state: the resharding matrix (tests/parallel/_matrix.py)
MATRIX_LEVELS = {level: ALL_LEVELS[level] for level in ("O0", "O1", "O2", "O3", "O4", "O5")}
MATRIX_LEVELS.update({"O6": {"opt_level": "O6"}, "O7": ALL_LEVELS["O7"],
                      "O7/bf16_state": {"opt_level": "O7", "optimizer_state_dtype": torch.bfloat16},
                      "O8": ALL_LEVELS["O8"], "remainder": ALL_LEVELS["remainder"]})
WIDTH = {"O6": 16}
# Losses of two runs that group the samples' gradients differently (another number of ranks,
# another mesh) agree to the rounding of the compute dtype, not bit for bit.
BF16 = dict(rtol=1e-2, atol=1e-2)
# fp8 (O6): e4m3 keeps 3 mantissa bits, and its per-tensor scales follow each rank's part of the batch.
TOLERANCE = {"O0": dict(rtol=1e-5, atol=1e-6), "O1": dict(rtol=2e-3, atol=2e-3), "O2": dict(rtol=2e-3, atol=2e-3),
             "O3": dict(rtol=2e-3, atol=2e-3), "O6": dict(rtol=3e-2, atol=3e-2)}


class Block(nn.Module):
    def __init__(self, width=8):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return torch.tanh(self.fc(x))


def build(level, seed, sgd=False, **kw):
    torch.manual_seed(seed)
    width = WIDTH.get(level, 8)
    net = nn.Sequential(nn.Linear(4, width), Block(width), Block(width), nn.Linear(width, 3))
    opt = (torch.optim.SGD(net.parameters(), lr=1e-2, momentum=0.9) if sgd else
           torch.optim.AdamW(net.parameters(), lr=1e-2, eps=1e-3))
    return ampkit.initialize(net, opt, **MATRIX_LEVELS[level], verbosity=0, max_loss_scale=2.0**10, fsdp=True,
                             fsdp_kwargs={"blocks": [Block], **kw})


def batch(step, rank, world_size):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(BATCH, 4, generator=g), torch.randn(BATCH, 3, generator=g)
    return x.chunk(world_size)[rank], y.chunk(world_size)[rank]


def train(model, opt, steps, rank, world_size):
    """The global mean loss of each step."""
    losses = []
    for step in steps:
        opt.zero_grad()
        x, y = batch(step, rank, world_size)
        loss = F.mse_loss(model(x).float(), y)
        with ampkit.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        loss = loss.detach()
        dist.all_reduce(loss)
        losses.append(loss.item() / world_size)
    return losses


def snapshot(model, opt):
    """The whole run as rank 0 sees it (empty dicts elsewhere): the model as full_state_dict
    gathers it, the whole optimizer state (in its own dtypes: float32, float16 at O3, bfloat16
    with bf16 state; O8's widened to float32), the loss scalers; and the rounder's seed and step
    (O7/O8; None at other levels)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    amp = ampkit.state_dict(optimizer=opt)
    optim = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    optim = copy.deepcopy(optim)  # on CPU its tensors are the optimizer's own ("step" counts on)
    return {"model": {k: v.clone() for k, v in full_state_dict(model).items()}, "optimizer": optim,
            "scalers": {k: v for k, v in amp.items() if k.startswith("loss_scaler")},
            "rounding": amp.get("stochastic_rounding")}


def assert_state_equal(got, want, level, where, rounded=False):
    """The run's model, loss scalers and optimizer state bit for bit; with ``rounded`` (float32
    state loaded into O8) the O8 state within one code of ``want``."""
    assert list(got["model"]) == list(want["model"]), where
    for k, v in want["model"].items():
        assert got["model"][k].dtype == v.dtype and torch.equal(got["model"][k], v), f"{where}: model[{k}]"
    assert got["scalers"] == want["scalers"], where
    assert got["optimizer"]["param_groups"] == want["optimizer"]["param_groups"], where
    assert got["optimizer"]["state"].keys() == want["optimizer"]["state"].keys(), where
    for name, state in want["optimizer"]["state"].items():
        mine = got["optimizer"]["state"][name]
        assert mine.keys() == state.keys(), f"{where}: {name}"
        for key, value in state.items():
            assert mine[key].dtype == value.dtype, f"{where}: {name}[{key}]"
            if rounded and level == "O8" and key != "step":
                assert_within_one_code(mine[key], value, key, f"{where}: {name}[{key}]")
            else:
                assert torch.equal(mine[key], value), f"{where}: {name}[{key}]"


def assert_within_one_code(got, want, key, where):
    """Float32 state loaded into O8 is quantized to nearest on O8's blocks: each value is one
    of the two codes of its block around the saved value. Bounds per tensor: int8 codes step by at most
    2 max|x| / 127; the e4m4 codes of a square root by at most 1/16 of it (plus the linear
    run's 2**-17 of the largest)."""
    if key == "exp_avg_sq":
        got, want = got.sqrt(), want.sqrt()
        bound = want / 16 + 2.0 ** -16 * want.max()
    else:
        bound = torch.full_like(want, 2 * float(want.abs().max()) / 127)
    assert bool(((got - want).abs() <= bound).all()), f"{where}: {(got - want).abs().max()}"
    assert not torch.equal(got, torch.zeros_like(got)) or torch.equal(want, torch.zeros_like(want)), where
