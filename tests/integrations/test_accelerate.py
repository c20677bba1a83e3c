"""accelerate: ampkit.initialize before AmpkitAccelerator.prepare trains as the plain ampkit loop."""
import pytest
import torch

pytest.importorskip("accelerate", reason="needs accelerate (pip install ampkit[accelerate])")

from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402

import ampkit  # noqa: E402
from ampkit.integrations.accelerate import AmpkitAccelerator, attach  # noqa: E402

from ._models import (  # noqa: E402
    LEVELS, level_options, loss_of, make_batches, make_net, make_optimizer, reference, same, weights)


@pytest.fixture(autouse=True)
def fresh_state():
    """accelerate keeps its state in process-wide singletons: each test starts from none."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def setup(level, schedule=False, accumulate=1, plain=False):
    kwargs = dict(cpu=True, gradient_accumulation_steps=accumulate)
    accelerator = attach(Accelerator(**kwargs)) if plain else AmpkitAccelerator(**kwargs)
    net = make_net()
    opt = make_optimizer(net.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) if schedule else None
    net, opt = ampkit.initialize(net, opt, **level_options(level))
    prepared = accelerator.prepare(net, opt, sched) if schedule else (*accelerator.prepare(net, opt), None)
    return (accelerator, *prepared)


def train(accelerator, net, opt, sched, batches, clip=None, explicit=True):
    skipped = []
    for x, y in batches:
        with accelerator.accumulate(net):
            loss = loss_of(net(x), y)
            if explicit:
                with ampkit.scale_loss(loss, opt) as scaled:
                    accelerator.backward(scaled)
            else:
                accelerator.backward(loss)  # AmpkitAccelerator.backward runs scale_loss itself
            if clip is not None and accelerator.sync_gradients:
                accelerator.clip_grad_norm_(net.parameters(), clip)
            opt.step()
            if sched is not None:
                sched.step()
            opt.zero_grad()
            if accelerator.sync_gradients:
                skipped.append(accelerator.optimizer_step_was_skipped)
    return skipped


@pytest.mark.parametrize("level", LEVELS)
def test_every_level_equals_the_plain_loop(level):
    batches = make_batches(4)
    accelerator, net, opt, _ = setup(level)
    assert type(opt).__name__ == "AcceleratedOptimizer"
    train(accelerator, net, opt, None, batches, explicit=level != "O2")
    assert same(weights(net), reference(level, batches)[0])


@pytest.mark.parametrize("level", ["O2", "O5", "O8"])
@pytest.mark.parametrize("plain", [False, True], ids=["AmpkitAccelerator", "attach"])
def test_clip_grad_norm_clips_what_the_optimizer_steps_on(level, plain):
    batches = make_batches(3)
    accelerator, net, opt, _ = setup(level, plain=plain)
    train(accelerator, net, opt, None, batches, clip=0.05)
    clipped = reference(level, batches, clip=0.05)[0]
    assert same(weights(net), clipped)
    assert not same(clipped, reference(level, batches)[0])  # the clip changed the update


def test_optimizer_step_was_skipped_and_the_scheduler_holds():
    batches = make_batches(5, bad=[2])  # batch 2 overflows fp16
    accelerator, net, opt, sched = setup("O2", schedule=True)
    skipped = train(accelerator, net, opt, sched, batches)
    assert skipped == [False, False, True, False, False]
    expected, lrs = reference("O2", batches, schedule=True)
    assert same(weights(net), expected)
    assert opt.param_groups[0]["lr"] == lrs[-1] == 1e-2 * 0.5 ** 4


@pytest.mark.parametrize("level", ["O2", "O5", "O7"])
def test_gradient_accumulation(level):
    batches = make_batches(6)
    accelerator, net, opt, _ = setup(level, accumulate=2)
    train(accelerator, net, opt, None, batches)
    assert same(weights(net), reference(level, batches, accumulate=2)[0])


@pytest.mark.parametrize("level", ["O2", "O5", "O7", "O8", "remainder"])
def test_save_state_and_load_state_resume_bit_exact(level, tmp_path):
    batches = make_batches(6, bad=[1])
    accelerator, net, opt, sched = setup(level, schedule=True)
    train(accelerator, net, opt, sched, batches[:3])
    accelerator.save_state(tmp_path / "state")
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator, net, opt, sched = setup(level, schedule=True)
    accelerator.load_state(tmp_path / "state")
    train(accelerator, net, opt, sched, batches[3:])
    expected, lrs = reference(level, batches, schedule=True)
    assert same(weights(net), expected)
    assert opt.param_groups[0]["lr"] == lrs[-1]
    if level == "O2":
        assert ampkit.loss_scalers(optimizer=opt)[0].loss_scale() == 2.0 ** 15  # halved before the save, restored


def test_mixed_precision_other_than_no_is_refused():
    accelerator = AmpkitAccelerator(cpu=True, mixed_precision="bf16")
    net = make_net()
    net, opt = ampkit.initialize(net, torch.optim.SGD(net.parameters(), lr=0.1), opt_level="O5", verbosity=0)
    with pytest.raises(ValueError, match="mixed_precision='no'"):
        accelerator.prepare(net, opt)


@pytest.mark.parametrize("level, masters", [("O2", True), ("O5", True), ("O1", False)])
def test_a_plain_accelerator_is_named_once_with_the_fix(level, masters, caplog):
    batches = make_batches(3)
    accelerator = Accelerator(cpu=True)
    net = make_net()
    net, opt = ampkit.initialize(net, make_optimizer(net.parameters()), **level_options(level))
    net, opt = accelerator.prepare(net, opt)
    with caplog.at_level("WARNING", logger="ampkit"):
        train(accelerator, net, opt, None, batches, clip=1.0)
    said = [r.getMessage() for r in caplog.records if "not attached" in r.getMessage()]
    assert len(said) == 1 and "AmpkitAccelerator" in said[0] and "attach(accelerator)" in said[0]
    assert ("clip nothing" in said[0]) == masters
    caplog.clear()
    attach(accelerator)  # then nothing more is said
    with caplog.at_level("WARNING", logger="ampkit"):
        train(accelerator, net, opt, None, batches, clip=1.0)
        train(*setup(level)[:3], None, batches, clip=1.0)
    assert not [r for r in caplog.records if "not attached" in r.getMessage()]
