"""Pickle paths of development builds between 0.2.0 and 0.3.0, which named ``ampkit.install.model_state``;
nothing else lives here."""
