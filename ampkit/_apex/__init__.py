"""Apex's surfaces before and beside amp: ``amp._amp_state`` and ``fp16_utils``."""
