"""ampkit inside training frameworks: one small module per framework, each imported only on use.

* ``ampkit.integrations.lightning``: ``AmpkitPrecision``, a Lightning ``Trainer`` precision plugin,
  and ``PrecisionReportCallback``;
* ``ampkit.integrations.accelerate``: ``AmpkitAccelerator`` (and ``attach`` for an existing
  ``Accelerator``) for a model and optimizer that went through ``ampkit.initialize``;
* ``ampkit.integrations.transformers``: ``AmpkitTrainer``, the ``Trainer`` at any opt level.

Fabric needs no module of its own: ``ampkit.initialize`` before ``fabric.setup``, and the
``ampkit`` module (or ``stateful.AmpkitState(optimizer)``) as a ``fabric.save`` entry. Shared:
``schedulers.hold_on_skipped_steps`` and ``stateful.AmpkitState``. ``import ampkit`` imports none
of these, nor any framework.
"""
