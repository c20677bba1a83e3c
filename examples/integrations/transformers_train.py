"""The transformers Trainer at any ampkit level, on a tiny Llama built from a config (no download):
python transformers_train.py --opt-level O8 --steps 30"""
import argparse

import torch
import transformers

from ampkit.integrations.transformers import AmpkitTrainer


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--opt-level", default="O5")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--output-dir", default="trainer_out")
    args = parser.parse_args()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config)
    rows = torch.arange(16).repeat(64, 2) % 64  # a sequence to learn: counting
    data = [{"input_ids": r, "labels": r.clone()} for r in rows]
    training_args = transformers.TrainingArguments(
        output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=8, learning_rate=3e-3,
        max_grad_norm=1.0, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True)
    trainer = AmpkitTrainer(model=model, args=training_args, train_dataset=data, opt_level=args.opt_level)
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    print(f"first loss {losses[0]:.4f}")
    print(f"final loss {losses[-1]:.4f}")


if __name__ == "__main__":
    main()
