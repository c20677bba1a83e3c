"""parallel/reshard.py in one process: the generator rule, the incomplete mark, the saved keys."""
import warnings

import pytest
import torch

from ampkit.parallel.reshard import INCOMPLETE, check_complete, rounding_of_shard, saved_metadata, saved_template


def _rows(n, seed=0):
    return torch.stack([torch.Generator().manual_seed(seed + i).get_state() for i in range(n)])


def test_existing_shards_continue_their_rows_and_new_shards_get_reproducible_distinct_states():
    saved = {"seed": 0, "generators": {"cpu": _rows(2)}}
    states = [rounding_of_shard(saved, i)["generators"]["cpu"] for i in range(4)]
    assert torch.equal(states[0], saved["generators"]["cpu"][0]) and torch.equal(states[1], saved["generators"]["cpu"][1])
    again = [rounding_of_shard(saved, i)["generators"]["cpu"] for i in range(4)]
    assert all(torch.equal(a, b) for a, b in zip(states, again))  # a function of the checkpoint and the index
    assert len({bytes(s.numpy()) for s in states}) == 4
    # nor the seeds a fresh run of 4 shards would start from (seed + index)
    assert all(not torch.equal(states[i], torch.Generator().manual_seed(i).get_state()) for i in (2, 3))
    # a later checkpoint (the rows moved on) gives new shards other states
    later = rounding_of_shard({"seed": 0, "generators": {"cpu": _rows(2, seed=7)}}, 2)["generators"]["cpu"]
    assert not torch.equal(later, states[2])
    assert rounding_of_shard(saved, 3)["seed"] == 0


def test_a_single_unsharded_state_is_shard_0s():
    state = torch.Generator().manual_seed(5).get_state()
    assert torch.equal(rounding_of_shard({"seed": 5, "generators": {"cpu": state}}, 0)["generators"]["cpu"], state)


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
