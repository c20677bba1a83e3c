"""The update engine: the memory levels' optimizer step (O5 masters, remainder, O7, O8)."""
