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
    assert set(wrappers) == {"ampkit._parallel.distributed"}  # ampkit's DDP, around the cast model
    got = weights(lit.net)
    expected = _reference(level, lit.seen)
    return same(got, expected), [w.sum().item() for w in got], len(lit.seen)


@pytest.mark.parametrize("level", ["O0", "O2", "O3", "O5", "O7", "remainder"])
def test_ddp_strategy_equals_ampkits_ddp_loop(level):
    results = run(_worker, 2, level)
    assert [r[0] for r in results] == [True, True]
    assert results[0][1] == results[1][1]  # the ranks agree
    assert [r[2] for r in results] == [4, 4]  # each rank saw its own half of the batches


class Gan(pl.LightningModule):
    """The GAN of Lightning's manual optimization docs: a D step on real and detached fake samples
    (G's parameters unused: DDP needs find_unused_parameters=True), then a G step through D."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.G = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16))
        self.D = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        real, z = batch
        g_opt, d_opt = self.optimizers()
        bce = torch.nn.functional.binary_cross_entropy_with_logits
        ones, zeros = torch.ones(len(real), 1), torch.zeros(len(real), 1)
        fake = self.G(z)
        d_loss = bce(self.D(real).float(), ones) + bce(self.D(fake.detach()).float(), zeros)
        d_opt.zero_grad()
        self.manual_backward(d_loss)
        d_opt.step()
        g_loss = bce(self.D(fake).float(), ones)
        g_opt.zero_grad()
        self.manual_backward(g_loss)
        g_opt.step()

    def configure_optimizers(self):
        return make_optimizer(self.G.parameters()), make_optimizer(self.D.parameters())


def _gan_worker(rank, world_size, level, strategy):
    from lightning.pytorch.strategies import DDPStrategy

    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="1")  # the process group exists already (_launch)
    if strategy == "options":
        strategy = DDPStrategy(find_unused_parameters=True, gradient_as_bucket_view=True, bucket_cap_mb=1)
    from ampkit.integrations.lightning import AmpkitPrecision

    g = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(3)]
    gan, wrappers = Gan(), []
    before = weights(gan)

    class Wrapper(pl.Callback):
        def on_train_batch_start(self, trainer, *args):
            wrappers.append(trainer.strategy.model)

    options = level_options(level)
    trainer = pl.Trainer(max_steps=6, accelerator="cpu", devices=world_size, strategy=strategy,
                         plugins=[AmpkitPrecision(options.pop("opt_level"), **options)], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[Wrapper()])
    trainer.fit(gan, torch.utils.data.DataLoader(batches, batch_size=None))
    ddp, after = wrappers[-1], weights(gan)
    return {"wrapper": type(ddp).__module__, "find_unused_parameters": ddp.find_unused_parameters,
            "gradient_as_bucket_view": ddp.gradient_as_bucket_view, "bucket_bytes_cap": ddp.bucket_bytes_cap,
            "moved": all(not torch.equal(a, b) for a, b in zip(before, after)),
            "finite": all(bool(torch.isfinite(w).all()) for w in after), "weights": after}


@pytest.mark.parametrize("level, strategy", [("O2", "ddp_find_unused_parameters_true"),
                                             ("O5", "ddp_find_unused_parameters_true"), ("O7", "options")])
def test_the_gan_of_lightnings_docs_under_ddp_with_its_options(level, strategy):
    ranks = run(_gan_worker, 2, level, strategy)
    for r in ranks:
        assert r["wrapper"] == "ampkit._parallel.distributed" and r["find_unused_parameters"]
        assert r["moved"] and r["finite"]  # every weight of G and D trained
    assert same(ranks[0]["weights"], ranks[1]["weights"])  # the ranks agree
    if strategy == "options":  # DDPStrategy's options reach ampkit's wrapper
        assert [r["gradient_as_bucket_view"] for r in ranks] == [True, True]
        assert [r["bucket_bytes_cap"] for r in ranks] == [2**20, 2**20]
