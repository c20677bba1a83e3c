"""Numeric kernels: pure tensor functions with no ampkit state (remainder masters, 8-bit block state)."""
