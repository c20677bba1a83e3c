"""``python -m ampkit report``: the precision report of the demo's built-in models."""
import argparse
from pathlib import Path
from typing import List, Optional

import torch
import torch.nn.functional as F

from .._precision import PrecisionReport, html, precision_report
from .demo_models import ConvNet, LMConfig, TinyLM, image_batches, lm_batches, lm_loss

MODELS = ("lm", "cnn")


def _lm_loss(model, batch):
    tokens, target = batch
    return lm_loss(model(tokens), target)


def _cnn_loss(model, batch):
    images, labels = batch
    return F.cross_entropy(model(images), labels)


def demo_report(name: str) -> PrecisionReport:
    """The report of demo model ``name`` ("lm" or "cnn"), seeded, with the demo's SGD (momentum 0.9)."""
    torch.manual_seed(0)
    if name == "lm":
        cfg = LMConfig()
        model, batches, loss_fn, lr = TinyLM(cfg), lm_batches(cfg, 2), _lm_loss, 0.3
    else:
        model, batches, loss_fn, lr = ConvNet(16), image_batches(2, batch=32, size=16), _cnn_loss, 0.05
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    return precision_report(model, loss_fn, batches, optimizer)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ampkit report", description="Which layers of the demo models each opt level would hurt.")
    p.add_argument("--model", choices=["lm", "cnn", "both"], default="both",
                   help="lm: tiny transformer LM; cnn: small BatchNorm conv net (default: both)")
    p.add_argument("--html", metavar="FILE", help="also write the report as one HTML page, FILE (both models' reports "
                                                  "on it, one after the other, for --model both)")
    return p


def main_report(argv: Optional[List[str]] = None) -> int:
    """Print the report (and its recommendation) of each chosen demo model; return the exit status."""
    args = parser().parse_args(argv)
    names = MODELS if args.model == "both" else (args.model,)
    pages = {}
    for name in names:
        report = demo_report(name)
        rec = report.recommend()
        print(f"== {name} ==\n{report}\n\nRecommended: {rec.level}: {rec.reason}\n")
        pages[name] = report.to_dict()
    if args.html:
        target = Path(args.html)
        target.write_text(html.render_models(pages) if len(pages) > 1 else html.render(pages[names[0]]), encoding="utf-8")
        print(f"wrote {target}")
    return 0
