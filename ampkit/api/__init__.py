"""The public calls of a training loop, over the run object and the step protocol."""
