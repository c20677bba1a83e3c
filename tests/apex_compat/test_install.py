"""``ampkit.apex_compat.install()`` in this process (the notebook switch): which apex names
resolve to which ampkit objects, the one stderr notice, and refusals."""
import importlib
import importlib.metadata
import importlib.util
import sys

import pytest

import ampkit
import ampkit.fp16_utils
import ampkit.parallel
from ampkit import apex_compat


def test_names_resolve_to_ampkit(standin, capsys):
    announced_before = apex_compat._Finder.announced
    import apex
    from apex import amp
    from apex.fp16_utils import FP16_Optimizer, to_python_float
    from apex.normalization import FusedLayerNorm
    from apex.parallel import DistributedDataParallel, SyncBatchNorm, convert_syncbn_model
    from apex.parallel.LARC import LARC

    assert amp.initialize is ampkit.initialize and amp.scale_loss is ampkit.scale_loss
    assert amp._amp_state is ampkit._amp_state and amp.master_params is ampkit.master_params
    assert FP16_Optimizer is ampkit.fp16_utils.FP16_Optimizer and to_python_float is ampkit.fp16_utils.to_python_float
    assert LARC is ampkit.parallel.LARC and DistributedDataParallel is ampkit.parallel.DistributedDataParallel
    assert SyncBatchNorm is ampkit.parallel.SyncBatchNorm and convert_syncbn_model is ampkit.parallel.convert_syncbn_model
    assert FusedLayerNorm is ampkit.normalization.FusedLayerNorm
    assert apex.amp is sys.modules["apex.amp"] and apex.fp16_utils.tofp16 is ampkit.fp16_utils.tofp16
    from apex.fp16_utils.fp16_optimizer import FP16_Optimizer as F2
    from apex.fp16_utils.loss_scaler import DynamicLossScaler

    assert F2 is FP16_Optimizer and DynamicLossScaler is ampkit.fp16_utils.DynamicLossScaler
    namespace = {}
    exec("from apex.fp16_utils import *", namespace)
    assert set(ampkit.fp16_utils.__all__) <= set(namespace)
    err = capsys.readouterr().err
    assert err.count("is standing in for NVIDIA Apex") == (0 if announced_before else 1)
    importlib.import_module("apex.parallel")
    assert "standing in" not in capsys.readouterr().err  # once per process


def test_missing_parts_say_what_to_use(standin):
    with pytest.raises(ModuleNotFoundError, match="apex.contrib has no ampkit counterpart"):
        import apex.contrib.optimizers  # noqa: F401
    with pytest.raises(ModuleNotFoundError, match="opt_level='O2'"):
        import apex.optimizers.fp16_optimizer  # noqa: F401
    with pytest.raises(ModuleNotFoundError, match="apex.fp16_utils, apex.optimizers and apex.multi_tensor_apply only"):
        import apex.amp.handle  # noqa: F401
    with pytest.raises(ModuleNotFoundError, match="torchrun"):
        import apex.parallel.multiproc  # noqa: F401
    from apex import amp, parallel

    with pytest.raises(AttributeError, match="ampkit.initialize"):
        amp.init()
    with pytest.raises(ImportError):
        from apex.parallel import Reducer  # noqa: F401
    with pytest.raises(AttributeError, match="all_reduce"):
        parallel.Reducer
    import torch.distributed

    assert parallel.ReduceOp is torch.distributed.ReduceOp


def test_uninstall_and_refusals(monkeypatch):
    monkeypatch.delenv(apex_compat.ENV, raising=False)
    apex_compat.install()
    import apex  # noqa: F401

    apex_compat.uninstall()
    assert not apex_compat.installed() and "apex" not in sys.modules
    with pytest.raises(ModuleNotFoundError):
        import apex  # noqa: F401,F811
    monkeypatch.setitem(sys.modules, "apex", type(sys)("apex"))
    with pytest.raises(apex_compat.ApexInstalledError, match="already imported"):
        apex_compat.install()
    monkeypatch.delitem(sys.modules, "apex")
    with pytest.raises(TypeError, match="shadow_installed_apex"):
        apex_compat.install(shadow_installed_apex="yes")
    monkeypatch.setenv(apex_compat.ENV, "maybe")
    with pytest.raises(ValueError, match="AMPKIT_APEX='maybe'"):
        apex_compat.install()
    monkeypatch.setenv(apex_compat.ENV, "apex")
    assert apex_compat.install() is False and not apex_compat.installed()
    assert not apex_compat.installed()


def test_apex_distribution_record_lives_and_dies_with_the_standin(monkeypatch, tmp_path):
    """What transformers' is_apex_available() reads: find_spec and the package metadata."""
    from packaging.version import Version

    monkeypatch.delenv(apex_compat.ENV, raising=False)
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("apex")
    apex_compat.install()
    try:
        assert importlib.util.find_spec("apex") is not None and importlib.util.find_spec("amp_C") is not None
        version = importlib.metadata.version("apex")
        assert version == f"0.1+ampkit.{ampkit.__version__}" and Version(version).local == f"ampkit.{ampkit.__version__}"
        dist = importlib.metadata.distribution("Apex")  # names are matched as pip normalizes them
        assert dist.metadata["Name"] == "apex" and "standing in for NVIDIA Apex" in dist.metadata["Summary"]
        assert dist.files is None and dist.requires is None
        assert importlib.metadata.packages_distributions()["apex"] == ["apex"]
        assert "apex" not in sys.modules  # metadata look-ups import nothing
        assert not [d for d in importlib.metadata.distributions(path=[str(tmp_path)]) if d.metadata["Name"] == "apex"]
        with pytest.raises(importlib.metadata.PackageNotFoundError):
            importlib.metadata.version("apex-contrib")
    finally:
        apex_compat.uninstall()
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.distribution("apex")
    assert importlib.util.find_spec("amp_C") is None


def test_standin_modules_hold_their_public_names(standin):
    """`'state_dict' in amp.__dict__` (a vision-repository checkpoint helper's test) holds;
    submodules stay lazy, as in any package."""
    from apex import amp, fp16_utils, optimizers, parallel

    assert amp.__dict__["state_dict"] is ampkit.state_dict and amp.__dict__["load_state_dict"] is ampkit.load_state_dict
    assert {"initialize", "scale_loss", "master_params", "LossScaler"} <= set(vars(amp)) <= set(dir(amp))
    assert "float8" not in vars(amp) and amp.float8 is importlib.import_module("ampkit.float8")
    assert vars(parallel)["DistributedDataParallel"] is ampkit.parallel.DistributedDataParallel
    assert vars(fp16_utils)["FP16_Optimizer"] is ampkit.fp16_utils.FP16_Optimizer
    assert set(optimizers.__all__) <= set(vars(optimizers))
    import apex

    assert {"amp", "parallel", "optimizers", "multi_tensor_apply", "fp16_utils", "normalization"} <= set(dir(apex))


def test_errors_through_the_standin_name_the_apex_module(standin):
    from apex import amp, fp16_utils

    with pytest.raises(AttributeError, match=r"^module 'apex.amp' has no attribute 'no_such_name'$"):
        amp.no_such_name
    with pytest.raises(AttributeError, match=r"^apex\.amp\.init: amp\.init\(\)"):
        amp.init
    with pytest.raises(AttributeError, match=r"^module 'apex.fp16_utils' has no attribute 'nope'"):
        fp16_utils.nope
