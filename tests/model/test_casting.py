import collections

import torch
from torch import nn

from ampkit._model.casting import cast_module_, cast_tree

Pair = collections.namedtuple("Pair", "a b")


class Batch:
    def __init__(self, x):
        self.x = x

    def to(self, dtype):
        return Batch(self.x.to(dtype))


def test_cast_tree_structures():
    src = {"t": (torch.ones(2), [torch.arange(3), torch.tensor([True])]), "p": Pair(torch.zeros(1), 3), "s": "x", "n": None}
    out = cast_tree(src, torch.bfloat16)
    assert out["t"][0].dtype == torch.bfloat16 and isinstance(out["t"], tuple) and isinstance(out["t"][1], list)
    assert out["t"][1][0].dtype == torch.int64 and out["t"][1][1].dtype == torch.bool
    assert isinstance(out["p"], Pair) and out["p"].a.dtype == torch.bfloat16 and out["p"].b == 3
    assert out["s"] == "x" and out["n"] is None
    assert src["t"][0].dtype == torch.float32
    assert cast_tree(Batch(torch.ones(1)), torch.float16).x.dtype == torch.float16


def test_cast_module_keeps_parameter_identity_and_batchnorm():
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2), nn.BatchNorm1d(2, affine=False))
    weight = model[0].weight
    n = cast_module_(model, torch.float16, keep_batchnorm_fp32=True)
    assert model[0].weight is weight and weight.dtype == torch.float16
    assert model[1].weight.dtype == torch.float32 and model[2].running_mean.dtype == torch.float32
    assert n == 2
    cast_module_(model, torch.bfloat16, keep_batchnorm_fp32=False)
    assert model[2].running_var.dtype == torch.bfloat16 and model[1].num_batches_tracked.dtype == torch.int64


def test_cast_module_leaves_mixed_norms_float32():
    from ampkit.normalization import FusedLayerNorm, MixedFusedRMSNorm

    model = nn.Sequential(nn.Linear(4, 4), MixedFusedRMSNorm(4), FusedLayerNorm(4))
    cast_module_(model, torch.bfloat16, keep_batchnorm_fp32=False)
    assert model[1].weight.dtype == torch.float32
    assert model[2].weight.dtype == torch.bfloat16 and model[0].weight.dtype == torch.bfloat16
    assert model(torch.randn(2, 4, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_cast_tree_dict_subclass_keeps_its_type():
    src = collections.OrderedDict(a=torch.ones(1), b=collections.defaultdict(int, c=torch.ones(1)))
    out = cast_tree(src, torch.float16)
    assert type(out) is collections.OrderedDict and type(out["b"]) is collections.defaultdict
    assert out["a"].dtype == out["b"]["c"].dtype == torch.float16 and out["b"]["missing"] == 0
    assert src["a"].dtype == torch.float32
