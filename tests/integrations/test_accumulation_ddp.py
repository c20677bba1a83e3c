"""Gradient accumulation through the frameworks with 2 gloo processes: the ranks agree bit for bit,
and equal ampkit's hand-written loop (``ddp=True``, ``no_sync()`` on all but the last micro-batch)."""
import contextlib
import os

import pytest
import torch

import ampkit

from parallel._launch import run  # noqa: E402  (tests/ is on sys.path: its folders are packages)
from ._models import level_options, loss_of, make_batches, make_net, make_optimizer, same, weights  # noqa: E402

pytestmark = pytest.mark.slow  # two processes

ACCUMULATE, STEPS = 2, 3
LEVELS = ["O0", "O2", "O8"]  # fp32; fp16 with dynamic scaling and fp32 masters; bf16 with 8-bit state


def _environment(rank, world_size):
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT="1")  # the process group exists already (_launch)


def _rank_batches(rank):
    return make_batches(2 * ACCUMULATE * STEPS)[rank::2]


def _hand_written(level, batches):
    """ampkit's own DDP loop with ``no_sync()`` micro-batches."""
    net = make_net()
    opt = make_optimizer(net.parameters())
    ddp, opt = ampkit.initialize(net, opt, ddp=True, **level_options(level))
    for i, (x, y) in enumerate(batches):
        last = (i + 1) % ACCUMULATE == 0
        with contextlib.nullcontext() if last else ddp.no_sync():
            with ampkit.scale_loss(loss_of(ddp(x), y) / ACCUMULATE, opt) as scaled:
                scaled.backward()
        if last:
            opt.step()
            opt.zero_grad()
    return weights(net)


def _lightning(rank, world_size, level):
    import lightning.pytorch as pl

    from ampkit.integrations.lightning import AmpkitPrecision

    from .test_lightning import Lit

    _environment(rank, world_size)
    lit = Lit()
    options = level_options(level)
    trainer = pl.Trainer(max_steps=STEPS, accelerator="cpu", devices=world_size, strategy="ddp",
                         accumulate_grad_batches=ACCUMULATE, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         plugins=[AmpkitPrecision(options.pop("opt_level"), **options)])
    data = make_batches(2 * ACCUMULATE * STEPS)
    trainer.fit(lit, torch.utils.data.DataLoader(data, batch_size=None))
    return weights(lit.net), lit.seen


def _fabric(rank, world_size, level):
    import lightning

    _environment(rank, world_size)
    fabric = lightning.Fabric(accelerator="cpu", devices=world_size, strategy="ddp")
    fabric.launch()  # the processes exist already (LOCAL_RANK is set): nothing is spawned
    net = make_net()
    opt = make_optimizer(net.parameters())
    net, opt = ampkit.initialize(net, opt, **level_options(level))
    model, opt = fabric.setup(net, opt)
    batches = _rank_batches(rank)
    for i, (x, y) in enumerate(batches):
        last = (i + 1) % ACCUMULATE == 0
        with fabric.no_backward_sync(model, enabled=not last):
            with ampkit.scale_loss(loss_of(model(x), y) / ACCUMULATE, opt) as scaled:
                fabric.backward(scaled)
        if last:
            opt.step()
            opt.zero_grad()
    return weights(net), batches


def _accelerate(rank, world_size, level):
    from accelerate.state import AcceleratorState, GradientState

    from ampkit.integrations.accelerate import AmpkitAccelerator

    _environment(rank, world_size)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = AmpkitAccelerator(cpu=True, gradient_accumulation_steps=ACCUMULATE)
    net = make_net()
    opt = make_optimizer(net.parameters())
    net, opt = ampkit.initialize(net, opt, **level_options(level))
    model, opt = accelerator.prepare(net, opt)
    assert isinstance(model, torch.nn.parallel.DistributedDataParallel)
    batches = _rank_batches(rank)
    for x, y in batches:
        with accelerator.accumulate(model):
            accelerator.backward(loss_of(model(x), y))  # AmpkitAccelerator.backward runs scale_loss
            opt.step()
            opt.zero_grad()
    return weights(net), batches


def _worker(rank, world_size, framework):
    train = {"lightning": _lightning, "fabric": _fabric, "accelerate": _accelerate}[framework]
    out = {}
    for level in LEVELS:
        got, batches = train(rank, world_size, level)
        out[level] = got, same(got, _hand_written(level, batches))
    return out


@pytest.fixture(scope="module")
def frameworks():
    """``frameworks(name)``: each rank's results, one launch per framework running every level."""
    done = {}

    def get(name):
        pytest.importorskip("accelerate" if name == "accelerate" else "lightning", reason=f"needs {name}")
        if name not in done:
            done[name] = run(_worker, 2, name, timeout=900)
        return done[name]
    return get


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("framework", ["lightning", "fabric", "accelerate"])
def test_accumulation_keeps_the_ranks_together(frameworks, framework, level):
    (a, a_same), (b, b_same) = (r[level] for r in frameworks(framework))
    assert all(torch.equal(x, y) for x, y in zip(a, b)), "the ranks' weights differ after accumulation"
    assert a_same and b_same, "the framework's accumulation differs from ampkit's hand-written DDP loop"


def _transformers(rank, world_size, tmp):
    from .test_transformers import trainer

    _environment(rank, world_size)
    out = {}
    for level in TRANSFORMERS_LEVELS:
        t = trainer(f"{tmp}/{level}", level, steps=STEPS, gradient_accumulation_steps=ACCUMULATE,
                    per_device_train_batch_size=2)
        t.train()
        out[level] = [p.detach().float().clone() for p in t.model.parameters()]
    return out


TRANSFORMERS_LEVELS = ["O5"]


@pytest.fixture(scope="module")
def transformers_ranks(tmp_path_factory):
    pytest.importorskip("transformers", reason="needs transformers (pip install ampkit[transformers])")
    return run(_transformers, 2, str(tmp_path_factory.mktemp("trainer")), timeout=900)


@pytest.mark.parametrize("level", TRANSFORMERS_LEVELS)
def test_transformers_trainer_accumulation_keeps_the_ranks_together(transformers_ranks, level):
    a, b = (r[level] for r in transformers_ranks)
    assert all(torch.equal(x, y) for x, y in zip(a, b)), "the ranks' weights differ after accumulation"
