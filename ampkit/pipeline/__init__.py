"""``initialize`` as a pipeline: parse, plan, check, apply, register, report, wrap.

Each step has its own module; only ``apply`` changes models and optimizers.
"""
