"""The transformers ``Trainer`` at any ampkit level: ``AmpkitTrainer(..., opt_level="O8")``.

``AmpkitTrainer`` initializes the model and the optimizer the Trainer creates (``create_optimizer``,
before ``accelerator.prepare``), and makes its ``Accelerator`` an ampkit one
(``ampkit.integrations.accelerate.attach``): ``backward`` runs in ``scale_loss``, ``max_grad_norm``
clips the fp32 masters, a skipped step is reported as skipped (the LR scheduler holds). Its
checkpoints hold ampkit's loss scalers and rounding state (``ampkit.pt``) beside the optimizer.
A saved model holds float32 weights (ampkit's ``state_dict``: the fp32 masters), and its
``config.json`` says ``float32``, so ``from_pretrained`` gives them back as saved.
Leave ``fp16``/``bf16`` off: ampkit does the mixed precision.
"""
import copy
import os
from typing import Optional

import torch
from transformers import Trainer

from .._initialize.initialize import initialize
from .._loop.state import load_state_dict, state_dict
from .._optim.optimizer_wrappers import unwrap
from .accelerate import attach

__all__ = ["AmpkitTrainer", "STATE_NAME"]

STATE_NAME = "ampkit.pt"
"""The file in a `Trainer` checkpoint directory that holds ampkit's state."""


class AmpkitTrainer(Trainer):
    """``transformers.Trainer`` training at ampkit's ``opt_level`` ("O0".."O8" or "auto");
    ``ampkit_options`` go to ``ampkit.initialize`` (e.g. ``{"master_weights": "remainder"}``)."""

    def __init__(self, *args, opt_level: str = "O5", ampkit_options: Optional[dict] = None, **kwargs):
        super().__init__(*args, **kwargs)
        if self.args.fp16 or self.args.bf16:
            raise ValueError(
                f"AmpkitTrainer(args=TrainingArguments(fp16={self.args.fp16}, bf16={self.args.bf16})): ampkit does the "
                f"mixed precision; leave fp16 and bf16 off and choose the level with opt_level=.")
        self.opt_level = opt_level
        self.ampkit_options = {"verbosity": 0, **(ampkit_options or {})}
        attach(self.accelerator)

    def create_optimizer(self, model=None):
        optimizer = super().create_optimizer(model)
        inner = unwrap(optimizer)
        if getattr(inner, "_ampkit", None) is None:
            initialize(self.model, inner, opt_level=self.opt_level, **self.ampkit_options)
        return optimizer

    def _save(self, output_dir: Optional[str] = None, state_dict: Optional[dict] = None) -> None:
        super()._save(output_dir, state_dict)
        model = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
        if self.args.should_save and getattr(model, "_ampkit", None) is not None and model.dtype != torch.float32:
            config = copy.deepcopy(model.config)  # save_pretrained named the model's half dtype
            config.dtype = torch.float32  # that of the weights ampkit's state_dict saved
            config.save_pretrained(output_dir or self.args.output_dir)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        super()._save_optimizer_and_scheduler(output_dir)
        if self.args.should_save:
            torch.save(state_dict(optimizer=self.optimizer), os.path.join(output_dir, STATE_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        path = None if checkpoint is None else os.path.join(checkpoint, STATE_NAME)
        if path is not None and os.path.isfile(path):
            load_state_dict(torch.load(path, weights_only=True), optimizer=self.optimizer)
