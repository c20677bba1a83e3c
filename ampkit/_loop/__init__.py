"""The calls of a training loop: scale_loss, master_params, state dicts, checkpoints, footprint."""
