"""What initialize attaches to a model: casting, autocasting, BatchNorm/LayerNorm surgery, copies."""
