"""One initialize call's run: the loss scaler, the overflow check, health, the process-wide registry."""
