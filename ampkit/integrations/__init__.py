"""ampkit inside training frameworks: one small module per framework, each imported only on use.

* ``ampkit.integrations.lightning``: ``AmpkitPrecision``, a Lightning ``Trainer`` precision plugin,
  and ``PrecisionReportCallback``;
* ``ampkit.integrations.fabric``: ``AmpkitState``, ampkit's loss scalers as a Fabric checkpoint entry;
* ``ampkit.integrations.accelerate``: ``prepare(accelerator)`` for an ``Accelerator`` whose model
  and optimizer went through ``ampkit.initialize``;
* ``ampkit.integrations.transformers``: ``AmpkitTrainer``, the ``Trainer`` at any opt level.

``import ampkit`` imports none of them, nor any framework.
"""
