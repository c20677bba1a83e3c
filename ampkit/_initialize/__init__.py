"""``initialize`` as named steps: request, plan, check, apply, report."""
