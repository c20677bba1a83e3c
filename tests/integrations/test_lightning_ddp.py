"""AmpkitPrecision under Lightning's DDP strategy on 2 CPU ranks (gloo) equals ampkit's own ddp=True loop."""
import os

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch", reason="needs lightning (pip install ampkit[lightning])")

import ampkit  # noqa: E402

from parallel._launch import run  # noqa: E402  (tests/ is on sys.path: its folders are packages)
from ._models import level_options, loss_of, make_batches, make_net, make_optimizer, same, weights  # noqa: E402

pytestmark = pytest.mark.slow  # two processes


def _reference(level, batches):
    """ampkit's own DDP loop on this rank's batches."""
    net = make_net()
    opt = make_optimizer(net.parameters())
    net, opt = ampkit.initialize(net, opt, ddp=True, **level_options(level))
    for x, y in batches:
        opt.zero_grad()
        with ampkit.scale_loss(loss_of(net(x), y), opt) as scaled:
            scaled.backward()
        opt.step()
    return weights(net.module)


def _worker(rank, world_size, level):
    from ampkit.integrations.lightning import AmpkitPrecision

    from .test_lightning import Lit

    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="1")  # the process group exists already (_launch)
    batches = make_batches(8, bad=[2])
    lit = Lit()
    wrappers = []

    class Wrapper(pl.Callback):
        def on_train_batch_start(self, trainer, *args):
            wrappers.append(type(trainer.strategy.model).__module__)

    options = level_options(level)
    trainer = pl.Trainer(max_steps=4, accelerator="cpu", devices=world_size, strategy="ddp",
                         plugins=[AmpkitPrecision(options.pop("opt_level"), **options)], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[Wrapper()])
    trainer.fit(lit, torch.utils.data.DataLoader(batches, batch_size=None))
    assert set(wrappers) == {"ampkit.parallel.distributed"}  # ampkit's DDP, around the cast model
    got = weights(lit.net)
    expected = _reference(level, lit.seen)
    return same(got, expected), [w.sum().item() for w in got], len(lit.seen)


@pytest.mark.parametrize("level", ["O0", "O2", "O3", "O5", "O7", "remainder"])
def test_ddp_strategy_equals_ampkits_ddp_loop(level):
    results = run(_worker, 2, level)
    assert [r[0] for r in results] == [True, True]
    assert results[0][1] == results[1][1]  # the ranks agree
    assert [r[2] for r in results] == [4, 4]  # each rank saw its own half of the batches
