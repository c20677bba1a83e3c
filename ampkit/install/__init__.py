"""What initialize installs on models and optimizers: casting, autocast regions, master weights, the step
protocol, overflow checks, the memory levels' updates and their state (the layer above core)."""
