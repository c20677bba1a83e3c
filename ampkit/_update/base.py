"""The update strategies' base: how one optimizer's step reaches the weights.

Each `UpdateKind` (``Properties.update``) has one class; ``initialize`` stores an instance as
``optimizer._ampkit.update`` and ampkit's ``optimizer.step()`` calls its `step` after the
overflow check. Design notes: docs/design/update-engine.md.
"""


class OptimizerUpdate:
    """``UpdateKind.OPTIMIZER``: the optimizer's own step on the parameters it holds.

    Hooks, by when they run: `attach` once (the end of ``initialize``'s attach), `step` at
    every ``optimizer.step()`` that is not skipped (a skipped step never reaches it)."""

    eager_under_compile = False  # whether a compiled optimizer.step() runs this update as one eager call

    def __init__(self, opt_state):
        self.opt_state = opt_state
        self.optimizer = opt_state.optimizer
        self.own_step = opt_state.own_step  # the optimizer's step, without torch's step hooks where ampkit runs them

    def attach(self) -> None:
        """Nothing to set up: the optimizer steps as it is."""

    def step(self) -> tuple:
        """``(the optimizer's result, the model parameters the step already wrote)``."""
        return self.own_step(), ()
