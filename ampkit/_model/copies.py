"""Copies of an initialized model (``copy.deepcopy``, ``AveragedModel``, pickling): EMA,
SWA and teacher models with float32 weights of their own.

No optimizer steps a copy, so nothing would ever refresh its master weights. Instead each
half parameter and half buffer of the copy is paired with a float32 tensor of its own (the
original's master value where there was one, else the half value) and the copy's
``state_dict()`` returns those float32 tensors themselves. An EMA written in place over
``ema.state_dict().values()`` (timm's ``ModelEmaV2``) therefore accumulates in float32.

The two sides of a pair are reconciled lazily, before the copy's forward and in its
``state_dict()``, by the tensors' version counters: a float32 tensor written since the last
reconciliation is rounded into its half twin; a half tensor written (``AveragedModel``
updates ``parameters()``, BatchNorm its running statistics) is widened into its float32
twin. A copy shares nothing with the original: its masters are its own.
"""
import torch
from torch import nn

from .._config.levels import HALF_DTYPES
from .._kernels.remainder import master as combined_master


def make_standalone(model: nn.Module) -> None:
    """Give a freshly unpickled or deep-copied initialized ``model`` float32 twins."""
    st = model._ampkit
    old = st.masters  # deep-copied with the model: keyed by the copy's own parameters
    remainders = getattr(st, "remainders", {})
    st.masters, st.synced, st.remainders = {}, {}, {}
    tensors = [p for p in model.parameters()] + [b for b in model.buffers()]
    for t in tensors:
        if t in st.masters or not t.is_floating_point() or t.dtype not in HALF_DTYPES:
            continue
        master = old.get(t)
        if master is None and t in remainders:
            master = combined_master(t.detach(), remainders[t])
        master = t.detach().float() if master is None else master.detach()
        st.masters[t] = master
        st.synced[t] = (t._version, master._version)
    st._param_ids = {id(p) for p in model.parameters()}


def sync_one(st, t: torch.Tensor, master: torch.Tensor) -> None:
    """Bring the half tensor ``t`` and its float32 twin ``master`` together (see above)."""
    seen = st.synced.get(t)
    if seen is None:
        return
    if master._version != seen[1]:
        with torch.no_grad():
            t.copy_(master)
    elif t._version != seen[0]:
        with torch.no_grad():
            master.copy_(t)
    else:
        return
    st.synced[t] = (t._version, master._version)


def sync(st) -> None:
    for t, master in st.masters.items():
        sync_one(st, t, master)
