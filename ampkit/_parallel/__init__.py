"""torch.distributed: DDP, gradient windows, FSDP2, synchronized BatchNorm, resharding, clean exit."""
