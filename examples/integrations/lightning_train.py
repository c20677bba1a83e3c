"""A Lightning Trainer at any ampkit level: python lightning_train.py --opt-level O8 --steps 50"""
import argparse

import lightning.pytorch as pl
import torch
from torch import nn

from ampkit.integrations.lightning import AmpkitPrecision


class Regressor(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).float(), y)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--opt-level", default="O5")
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    torch.manual_seed(0)
    x = torch.randn(512, 32)
    y = x[:, :1] * 2 - x[:, 1:2]
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32, shuffle=True)
    trainer = pl.Trainer(max_steps=args.steps, accelerator="cpu", devices=1, plugins=[AmpkitPrecision(args.opt_level)],
                         logger=False, enable_checkpointing=False, enable_progress_bar=False)
    model = Regressor()
    first = None
    for batch in loader:  # the loss before training, for the printout
        first = nn.functional.mse_loss(model.net(batch[0]), batch[1]).item()
        break
    trainer.fit(model, loader)
    metrics = trainer.callback_metrics
    print(f"first loss {first:.4f}")
    print(f"final loss {float(metrics['loss']):.4f}")
    print(f"loss scale {float(metrics['ampkit/loss_scale']):g}, skipped steps {int(metrics['ampkit/skipped_steps'])}")


if __name__ == "__main__":
    main()
