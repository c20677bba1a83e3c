"""``python -m ampkit``: the demo, the levels table, the precision report."""
