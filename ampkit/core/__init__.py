"""The bottom layer: levels and options as data, the loss scaler, casting, rounding, the run
object and the one process-wide registry. Nothing here imports a module above it."""
