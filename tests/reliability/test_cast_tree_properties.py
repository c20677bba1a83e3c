"""Property test: ``cast_tree`` over random nested inputs/outputs.

Floating tensors come back in the target dtype with their values (as ``Tensor.to`` gives
them); integer, bool and complex tensors, None, numbers and strings come back as the very
same objects; lists, tuples, named tuples and dicts keep their type, length, keys and
order; the caller's containers are never mutated.
"""
import collections

import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from ampkit._model.casting import cast_tree

Pair = collections.namedtuple("Pair", "first second")
FLOATING = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
OTHER = [torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool, torch.complex64]


@st.composite
def tensors(draw, dtypes):
    dtype = draw(st.sampled_from(dtypes))
    shape = draw(st.lists(st.integers(0, 3), max_size=3))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    t = torch.randn(shape, generator=g, dtype=torch.float64) * 100
    if dtype == torch.bool:
        return t > 0
    if dtype == torch.complex64:
        return torch.complex(t.float(), -t.float())
    return t.to(dtype)


class Batch:
    """A user batch type that knows how to cast itself (Apex's custom-batch contract)."""

    def __init__(self, t):
        self.t = t

    def to(self, dtype):
        return Batch(self.t.to(dtype) if self.t.is_floating_point() else self.t)


leaves = (
    tensors(FLOATING)
    | tensors(OTHER)
    | st.none()
    | st.integers(-5, 5)
    | st.floats(allow_nan=False)
    | st.booleans()
    | st.text(max_size=3)
    | tensors(FLOATING).map(Batch)
)
trees = st.recursive(
    leaves,
    lambda kids: st.lists(kids, max_size=3)
    | st.lists(kids, max_size=3).map(tuple)
    | st.tuples(kids, kids).map(lambda p: Pair(*p))
    | st.dictionaries(st.text(max_size=2), kids, max_size=3)
    | st.dictionaries(st.text(max_size=2), kids, max_size=3).map(collections.OrderedDict),
    max_leaves=12,
)


def _frozen(obj):
    """A deep record of ``obj`` (identities and structure) to prove it was not mutated."""
    if isinstance(obj, dict):
        return (type(obj), [(k, id(v), _frozen(v)) for k, v in obj.items()])
    if isinstance(obj, (list, tuple)):
        return (type(obj), [(id(v), _frozen(v)) for v in obj])
    if torch.is_tensor(obj):
        return (obj.dtype, tuple(obj.shape))
    return id(obj)


def _check(src, out, dtype):
    if torch.is_tensor(src):
        if src.is_floating_point():
            assert torch.is_tensor(out) and out.dtype == dtype and out.shape == src.shape
            assert torch.equal(out, src.to(dtype))
            if src.dtype == dtype:
                assert out is src  # nothing to do: no copy
        else:
            assert out is src, (src.dtype, out)
        return
    if isinstance(src, Batch):
        assert isinstance(out, Batch)
        _check(src.t, out.t, dtype)
        return
    if isinstance(src, dict):
        assert type(out) is type(src) and list(out) == list(src)
        for k in src:
            _check(src[k], out[k], dtype)
        return
    if isinstance(src, (list, tuple)):
        assert type(out) is type(src) and len(out) == len(src)
        for a, b in zip(src, out):
            _check(a, b, dtype)
        return
    assert out is src, (src, out)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tree=trees, dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32]))
def test_cast_tree_casts_floating_tensors_and_nothing_else(tree, dtype):
    record = _frozen(tree)
    out = cast_tree(tree, dtype)
    _check(tree, out, dtype)
    assert _frozen(tree) == record  # the caller's structure is untouched
