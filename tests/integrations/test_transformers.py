"""The transformers Trainer at every level through AmpkitTrainer: a tiny Llama built from a config."""
import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs transformers (pip install ampkit[transformers])")

import ampkit  # noqa: E402
from ampkit.integrations.transformers import STATE_NAME, AmpkitTrainer  # noqa: E402

from ._models import LEVELS, level_options  # noqa: E402

HALF = {"O2": torch.float16, "O3": torch.float16, "O5": torch.bfloat16, "O6": torch.bfloat16,
        "O7": torch.bfloat16, "O8": torch.bfloat16, "remainder": torch.bfloat16}


def tiny_llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    return transformers.LlamaForCausalLM(config)


def dataset(n=24):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (n, 8), generator=g)
    # "note" is no argument of forward: the Trainer must drop that column and keep the others
    return [{"input_ids": row, "labels": row.clone(), "note": i} for i, row in enumerate(ids)]


def trainer(tmp_path, level, steps=4, model=None, optimizers=(None, None), **args):
    options = level_options(level)
    opt_level = options.pop("opt_level")
    args = transformers.TrainingArguments(**{
        "output_dir": str(tmp_path), "max_steps": steps, "per_device_train_batch_size": 4, "learning_rate": 1e-2,
        "logging_steps": 1, "save_strategy": "no", "report_to": [], "use_cpu": True, "seed": 3, "disable_tqdm": True,
        "dataloader_num_workers": 0, **args})
    return AmpkitTrainer(model=model or tiny_llama(), args=args, train_dataset=dataset(), opt_level=opt_level,
                         ampkit_options=options, optimizers=optimizers)


def weights(model):
    return [t.detach().float().clone() for t in model.state_dict().values()]


@pytest.mark.parametrize("level", LEVELS)
def test_every_level_trains(level, tmp_path):
    t = trainer(tmp_path, level)
    before = weights(t.model)
    t.train()
    after = weights(t.model)
    assert t.state.global_step == 4
    assert any(not torch.equal(a, b) for a, b in zip(before, after))
    assert all(torch.isfinite(w).all() for w in after)
    assert t.model.model.layers[0].mlp.up_proj.weight.dtype == HALF.get(level, t.model.model.layers[0].mlp.up_proj.weight.dtype)
    losses = [e["loss"] for e in t.state.log_history if "loss" in e]
    assert len(losses) == 4 and all(loss == loss for loss in losses)


@pytest.mark.parametrize("level", ["O2", "O5", "O7", "O8", "remainder"])
def test_resume_from_its_checkpoint_is_bit_exact(level, tmp_path):
    whole = trainer(tmp_path / "whole", level, steps=6, save_strategy="steps", save_steps=3)
    whole.train()
    checkpoint = tmp_path / "whole" / "checkpoint-3"
    assert (checkpoint / STATE_NAME).is_file()
    resumed = trainer(tmp_path / "resumed", level, steps=6)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert all(torch.equal(a, b) for a, b in zip(weights(whole.model), weights(resumed.model)))
    assert resumed.lr_scheduler.last_epoch == whole.lr_scheduler.last_epoch == 6


@pytest.mark.parametrize("level", ["O2", "O5", "O8"])
def test_a_skipped_step_holds_the_scheduler(level, tmp_path):
    model = tiny_llama()
    calls = []

    def overflow_second_forward(module, args, output):
        calls.append(None)
        return output * float("inf") if len(calls) == 2 else output

    model.lm_head.register_forward_hook(overflow_second_forward)
    t = trainer(tmp_path, level, model=model)
    t.train()
    opt = t.optimizer
    assert ampkit.loss_scalers(optimizer=opt)[0].skipped_steps == 1
    assert t.state.global_step == 4 and t.lr_scheduler.last_epoch == 3  # one step skipped: one scheduler step held
    assert all(torch.isfinite(w).all() for w in weights(t.model))


@pytest.mark.parametrize("level", ["O2", "O5", "remainder"])
def test_max_grad_norm_clips_what_the_optimizer_steps_on(level, tmp_path):
    t = trainer(tmp_path, level, steps=1, optim="sgd", lr_scheduler_type="constant", max_grad_norm=1e-3,
                weight_decay=0.0)
    before = weights(t.model)
    t.train()
    moved = torch.cat([(a - b).flatten() for a, b in zip(weights(t.model), before)]).norm().item()
    # plain SGD: the update is lr * the clipped gradient, of norm lr * max_grad_norm = 1e-5
    assert moved == pytest.approx(1e-5, rel=0.02)
    assert t.state.log_history[0]["grad_norm"] > 1e-3  # the norm before clipping, of the masters' gradients


@pytest.mark.parametrize("level", ["O2", "O5", "O8"])
def test_a_model_initialized_before_the_trainer_keeps_its_batch_columns(level, tmp_path):
    # remove_unused_columns keeps the columns forward's signature names: an initialized model must show its own
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = ampkit.initialize(model, opt, **level_options(level))
    t = trainer(tmp_path, level, model=model, optimizers=(opt, None))
    assert t.optimizer is opt
    t.train()
    assert t.state.global_step == 4
    assert all(torch.isfinite(w).all() for w in weights(t.model))


@pytest.mark.parametrize("level", ["O1", "O2", "O5", "O7", "remainder"])
def test_save_model_reloads_as_saved(level, tmp_path):
    t = trainer(tmp_path, level, steps=2)
    t.train()
    t.save_model(str(tmp_path / "final"))
    saved = t.model.state_dict()  # float32: the masters, or the half weights widened
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "final")).state_dict()
    assert {v.dtype for v in saved.values()} == {v.dtype for v in reloaded.values()} == {torch.float32}
    assert all(torch.equal(reloaded[k], v) for k, v in saved.items())
