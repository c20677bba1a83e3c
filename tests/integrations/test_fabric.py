"""Fabric: ampkit.initialize before fabric.setup, scale_loss around fabric.backward, fabric.save/load."""
import pytest
import torch

lightning = pytest.importorskip("lightning", reason="needs lightning (pip install ampkit[lightning])")

import ampkit  # noqa: E402
from ampkit.integrations.schedulers import hold_on_skipped_steps  # noqa: E402

from ._models import (  # noqa: E402
    LEVELS, level_options, loss_of, make_batches, make_net, make_optimizer, reference, same, weights)


def setup(level, schedule=False):
    fabric = lightning.Fabric(accelerator="cpu", devices=1)
    net = make_net()
    opt = make_optimizer(net.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) if schedule else None
    net, opt = ampkit.initialize(net, opt, **level_options(level))
    net, opt = fabric.setup(net, opt)
    if sched is not None:
        hold_on_skipped_steps(sched)
    return fabric, net, opt, sched


def train(fabric, net, opt, sched, batches, clip=None):
    for x, y in batches:
        opt.zero_grad()
        loss = loss_of(net(x), y)
        with ampkit.scale_loss(loss, opt) as scaled:
            fabric.backward(scaled)
        if clip is not None:
            fabric.clip_gradients(net, opt, max_norm=clip, error_if_nonfinite=False)  # as the docs write it
        opt.step()
        if sched is not None:
            sched.step()


@pytest.mark.parametrize("level", LEVELS)
def test_every_level_equals_the_plain_loop(level):
    batches = make_batches(4)
    fabric, net, opt, _ = setup(level)
    assert type(opt).__name__.startswith("Fabric")
    train(fabric, net, opt, None, batches)
    assert same(weights(net.module), reference(level, batches)[0])


@pytest.mark.parametrize("level", ["O2", "O5", "O8"])
def test_clip_gradients_clips_the_masters(level):
    batches = make_batches(3)
    fabric, net, opt, _ = setup(level)
    train(fabric, net, opt, None, batches, clip=0.05)
    assert same(weights(net.module), reference(level, batches, clip=0.05)[0])


def test_the_documented_clip_on_the_steps_ampkit_skips():
    batches = make_batches(5, bad=[0, 2])  # two overflowing steps early on, as O2's first steps at 2^16
    fabric, net, opt, _ = setup("O2")
    train(fabric, net, opt, None, batches, clip=0.05)
    assert ampkit.loss_scalers(optimizer=opt)[0].skipped_steps == 2
    assert same(weights(net.module), reference("O2", batches, clip=0.05)[0])


@pytest.mark.parametrize("level", ["O2", "O5"])
def test_a_batch_dropped_inside_scale_loss_is_forgotten_by_the_fabric_optimizers_zero_grad(level):
    batches = make_batches(4)
    fabric, net, opt, _ = setup(level)
    x, y = batches[0]
    with pytest.raises(KeyboardInterrupt):
        with ampkit.scale_loss(loss_of(net(x), y), opt) as scaled:
            fabric.backward(scaled)
            raise KeyboardInterrupt
    train(fabric, net, opt, None, batches[1:])  # its zero_grad() must clear the dropped batch's scaled gradients
    assert same(weights(net.module), reference(level, batches[1:])[0])


@pytest.mark.parametrize("level", ["O2", "O5", "O7", "O8", "remainder"])
def test_fabric_save_and_load_resume_bit_exact(level, tmp_path):
    batches = make_batches(6, bad=[1])
    fabric, net, opt, sched = setup(level, schedule=True)
    train(fabric, net, opt, sched, batches[:3])
    fabric.save(tmp_path / "ckpt", {"model": net, "optimizer": opt, "scheduler": sched, "amp": ampkit})
    fabric, net, opt, sched = setup(level, schedule=True)
    fabric.load(tmp_path / "ckpt", {"model": net, "optimizer": opt, "scheduler": sched, "amp": ampkit})
    train(fabric, net, opt, sched, batches[3:])
    expected, lrs = reference(level, batches, schedule=True)
    assert same(weights(net.module), expected)
    assert opt.param_groups[0]["lr"] == lrs[-1]
    if level == "O2":
        assert ampkit.loss_scalers(optimizer=opt)[0].loss_scale() == 2.0 ** 15  # halved before the save, restored
