"""The version, in one place (``ampkit.__version__``)."""
__version__ = "0.3.0"
