"""``apex.multi_tensor_apply`` in the stand-in: ``multi_tensor_applier(op, noop_flag,
tensor_lists, *args)`` calls ``op(chunk_size, noop_flag, tensor_lists, *args)``, as Apex's
did; the ops are those of the stand-in's ``amp_C`` (torch ``_foreach`` ops, any device)."""

__all__ = ["MultiTensorApply", "multi_tensor_applier"]


class MultiTensorApply:
    """Apex's applier: always ``available`` here, since the stand-in's ops need no CUDA build."""

    available = True
    warned = False

    def __init__(self, chunk_size: int):
        self.chunk_size = chunk_size

    def __call__(self, op, noop_flag_buffer, tensor_lists, *args):
        return op(self.chunk_size, noop_flag_buffer, tensor_lists, *args)


multi_tensor_applier = MultiTensorApply(2048 * 32)
