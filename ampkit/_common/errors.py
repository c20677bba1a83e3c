"""Warning classes ampkit emits."""


class NoEffectWarning(UserWarning):
    """An ampkit option or transform was requested but changes nothing here."""
