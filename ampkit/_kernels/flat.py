"""Lists of tensors as one flat tensor: a view where they lie back to back in one storage
(as the transient update's fp32 copies do), so one kernel covers them all without a copy."""
from typing import List, Optional

import torch
from torch._utils import _flatten_dense_tensors


def flat_view(ts: List[torch.Tensor]) -> Optional[torch.Tensor]:
    """``ts`` (at least one) as one flat view when they lie back to back in one storage, else ``None``."""
    first, at = ts[0], ts[0].data_ptr()
    for t in ts:
        if t.data_ptr() != at or not t.is_contiguous():
            return None
        at += t.numel() * t.element_size()
    storage = first.untyped_storage()  # one run of memory inside the first's storage is that storage's
    if at > storage.data_ptr() + storage.nbytes():
        return None
    return first.as_strided((sum(t.numel() for t in ts),), (1,))


def flat(ts: List[torch.Tensor]) -> torch.Tensor:
    """``ts`` (at least one) as one flat tensor: `flat_view`, else a concatenated copy."""
    view = flat_view(ts)
    return _flatten_dense_tensors(ts) if view is None else view
