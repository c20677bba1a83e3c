"""parallel/reshard.py in one process: the incomplete mark, the saved keys (an older layout's generator rows too)."""
import warnings

import pytest
import torch

from ampkit._parallel.reshard import INCOMPLETE, check_complete, saved_metadata, saved_template


def _rows(n, seed=0):  # generator states as older O7/O8 sharded checkpoints saved them, one row per shard
    return torch.stack([torch.Generator().manual_seed(seed + i).get_state() for i in range(n)])


def test_a_directory_marked_incomplete_is_refused(tmp_path):
    check_complete(tmp_path)  # no mark: fine
    check_complete("s3://bucket/ckpt")  # not a local directory: left to DCP
    (tmp_path / INCOMPLETE).write_text("started")
    with pytest.raises(ValueError, match="the checkpoint is incomplete: save_sharded started writing it but did not finish"):
        check_complete(tmp_path)


def test_saved_template_has_the_saved_keys_and_shapes(tmp_path):
    import torch.distributed.checkpoint as dcp

    rows = _rows(3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is ... uninitialized": one process
        dcp.save({"model": {"w": torch.ones(2)}, "amp": {"loss_scaler0": {"loss_scale": 2.0, "unskipped": 1},
                                                          "stochastic_rounding": {"seed": 0, "generators": {"cpu": rows}}}},
                 checkpoint_id=tmp_path)
    template = saved_template(saved_metadata(tmp_path), "amp")
    assert template["loss_scaler0"] == {"loss_scale": None, "unskipped": None}
    gens = template["stochastic_rounding"]["generators"]
    assert gens["cpu"].shape == rows.shape and gens["cpu"].dtype == torch.uint8
    assert saved_template(saved_metadata(tmp_path), "run") is None
    assert saved_metadata(tmp_path / "absent") is None


@pytest.mark.parametrize("call", ["save_sharded", "load_sharded"])
def test_extra_that_is_not_a_dict_is_refused_before_anything(tmp_path, call):
    import ampkit
    from ampkit import parallel

    model = torch.nn.Linear(2, 2)
    model, opt = ampkit.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O5", verbosity=0)
    with pytest.raises(TypeError, match=rf"ampkit.parallel.{call}\(extra=list\): expected a dict"):
        getattr(parallel, call)(tmp_path / "c", model, opt, extra=[1])
    assert not (tmp_path / "c").exists()
