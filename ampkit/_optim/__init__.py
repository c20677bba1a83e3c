"""What initialize attaches to an optimizer: the step protocol, fp32 masters, wrappers, step hooks."""
