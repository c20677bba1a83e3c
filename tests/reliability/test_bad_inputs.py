"""Every bad input we tried, as one table: the exception and the message a user sees.

Each row runs on fresh objects and asserts the exception type, a message fragment naming
the argument, and that model, optimizer, loss scalers (and any other model involved) are
bit-identical afterwards and still usable. Rows whose exception is None must *work*
(calling optimizer.step() before any backward at O2/O5 — Apex crashed there) or take
ampkit's documented non-exception path (a non-finite loss: the step is skipped and
reported). ``BAD_INPUTS.md`` is this table rendered for the docs (Troubleshooting includes it); a test keeps
it in sync (``AMPKIT_WRITE_BAD_INPUTS=1 python -m pytest tests/reliability/test_bad_inputs.py``
rewrites it). The session summary prints "N bad inputs checked".
"""
import argparse
import dataclasses
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, List, Optional

import pytest
import torch
from torch import nn

import ampkit
from ampkit import checkpoint, footprint
from ampkit.checkpoint import CheckpointError

from ._harness import LOSSES, Tiny, all_finite, assert_unchanged, diff, fixed_batch, make, snapshot

MD = Path(__file__).with_name("BAD_INPUTS.md")
NAN, INF = float("nan"), float("inf")


@dataclasses.dataclass
class Env:
    model: nn.Module
    opt: torch.optim.Optimizer
    x: torch.Tensor
    y: torch.Tensor
    others: List[nn.Module] = dataclasses.field(default_factory=list)
    tmp: Optional[Path] = None


def raw(opt_name="sgd"):
    model, opt = make(opt_name)
    x, y = fixed_batch()
    LOSSES[0](model(x), y).backward()
    opt.step()  # some optimizer state that must survive
    opt.zero_grad()
    return Env(model, opt, x, y)


def init(level="O2", opt_name="sgd", **kw):
    e = raw(opt_name)
    kw.setdefault("verbosity", 0)
    ampkit.initialize(e.model, e.opt, opt_level=level, **kw)
    return e


def with_foreign_param():
    torch.manual_seed(0)
    model, stranger = Tiny(), nn.Linear(2, 2)
    opt = torch.optim.SGD(list(model.parameters()) + list(stranger.parameters()), lr=0.1)
    x, y = fixed_batch()
    return Env(model, opt, x, y, others=[stranger])


def lbfgs():
    model, _ = make()
    x, y = fixed_batch()
    return Env(model, torch.optim.LBFGS(model.parameters()), x, y)


def nan_weight():
    e = raw()
    with torch.no_grad():
        e.model.fc2.weight[0, 0] = NAN
    return e


def cast_after_initialize():
    e = init("O2")
    e.model.float()  # the half Linear layers back to float32
    return e


def sparse_embedding():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 3))
    x, y = fixed_batch()
    e = Env(model, torch.optim.SGD(model.parameters(), lr=0.1), x, y)
    e.others, e.model = [model], make()[0]  # the table trains a Tiny afterwards
    e.opt = torch.optim.SGD(e.model.parameters(), lr=0.1)
    return e


def on_meta():
    with torch.device("meta"):
        model = Tiny()
    x, y = fixed_batch()
    return Env(model, torch.optim.SGD(model.parameters(), lr=0.1), x, y)


def ddp_wrapped():
    import torch.distributed as dist

    e = raw()
    fd, store = tempfile.mkstemp()
    os.close(fd)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        e.others = [e.model]
        e.model = nn.parallel.DistributedDataParallel(e.model)
    finally:
        dist.destroy_process_group()
        os.unlink(store)
    return e


def with_other(level="O2", **kw):
    e = init(level, **kw)
    torch.manual_seed(3)
    e.others = [Tiny()]
    return e


def two_sessions():
    e = init("O2")
    torch.manual_seed(3)
    m2 = Tiny()
    o2 = torch.optim.SGD(m2.parameters(), lr=0.1)
    ampkit.initialize(m2, o2, opt_level="O2", verbosity=0)
    e.others = [m2]
    e.o2 = o2
    return e


def with_checkpoint(kind):
    def setup():
        src = init("O2", num_losses=2) if kind == "two-losses" else init("O2", "adamw") if kind == "adamw" else None
        e = init("O2", num_losses=1)
        e.tmp = Path(tempfile.mkdtemp())
        path = e.tmp / "c.ckpt"
        checkpoint.save(path, *((src.model, src.opt) if src else (e.model, e.opt)))
        if kind == "truncated":
            path.write_bytes(path.read_bytes()[:-200])
        if kind == "plain":
            torch.save(e.model.state_dict(), path)
        return e
    return setup


# --- calls -------------------------------------------------------------------------------

def initialize(**kw):
    kw.setdefault("opt_level", "O2")
    return lambda e: ampkit.initialize(e.model, e.opt, **kw)


def scaled_step(loss_fn, loss_id=0, **kw):
    def call(e):
        with ampkit.scale_loss(loss_fn(e), e.opt, loss_id=loss_id, **kw) as s:
            s.backward()
        e.opt.step()
    return call


def mse(e):
    return LOSSES[0](e.model(e.x), e.y)


def nan_loss(e):
    bad = e.x.clone()
    bad[0, 0] = NAN
    return LOSSES[0](e.model(bad), e.y)


def inf_loss(e):
    return (e.model(e.x).float() * INF).abs().mean()


def open_window():
    """Loss 0's accumulation window is open: its gradients are still scaled."""
    e = init("O2", num_losses=2)
    with ampkit.scale_loss(mse(e), e.opt, loss_id=0, delay_unscale=True) as s:
        s.backward()
    e.window_open = True
    return e


def skipped_once(e):
    assert e.opt._ampkit.run.scalers[0].skipped_steps == 1


def plain_nan_backward_then_step(e):
    """``loss.backward()`` outside scale_loss (a framework loop) on a NaN batch, then ``step()``."""
    nan_loss(e).backward()
    e.opt.step()


def nested_scale_loss(e):
    with ampkit.scale_loss(mse(e), e.opt):
        with ampkit.scale_loss(mse(e), e.opt):
            pass


def amp_load(state):
    return lambda e: ampkit.load_state_dict(state)


def model_load(mutate):
    def call(e):
        sd = {k: v.clone() for k, v in e.model.state_dict().items()}
        mutate(sd)
        e.model.load_state_dict(sd)
    return call


def opt_from_other_layout(e):
    params = list(e.model.parameters())
    other = torch.optim.SGD([{"params": params[:2]}, {"params": params[2:]}], lr=0.1)
    e.opt.load_state_dict(other.state_dict())


def _scaler(scale=8.0, unskipped=3, **extra):
    return dict(loss_scale=scale, unskipped=unskipped, **extra)


# --- the table ---------------------------------------------------------------------------

@dataclasses.dataclass
class Row:
    argument: str
    value: str
    setup: Callable[[], Env]
    call: Callable[[Env], Any]
    exc: Optional[type]
    message: str
    check: Optional[Callable[[Env], None]] = None  # more to verify after the call
    changes: frozenset = frozenset()  # state the call may change (the scale backing off)
    where: str = "initialize"

    @property
    def id(self):
        return f"{self.where}:{self.argument}={self.value}"


def step_inside_block(e):
    with ampkit.scale_loss(mse(e), e.opt) as s:
        s.backward()
        e.opt.step()


def I(argument, value, exc, message, setup=raw, call=None, **kw):  # noqa: E743 - a row of initialize()
    return Row(argument, value, setup, call or initialize(**{argument: eval(value)}), exc, message, **kw)


TABLE = [
    # opt_level: digit-zero and lower-case typos, unknown names, wrong types
    *[I("opt_level", repr(f"0{d}"), ValueError, f"did you mean 'O{d}' (letter O)?") for d in range(6)],
    I("opt_level", "'o2'", ValueError, "did you mean 'O2' (letter O)?"),
    I("opt_level", "'O9'", ValueError, "initialize(opt_level='O9'): unknown opt level"),
    I("opt_level", "'O2 '", ValueError, "initialize(opt_level='O2 '): unknown opt level"),
    I("opt_level", "2", ValueError, "initialize(opt_level=2): unknown opt level"),
    I("opt_level", "None", ValueError, "initialize(opt_level=None): an opt_level is required"),
    # overrides of the wrong kind
    I("cast_model_type", "'float16'", TypeError, "initialize(cast_model_type='float16')"),
    I("cast_model_type", "torch.int64", TypeError, "initialize(cast_model_type=torch.int64)"),
    I("cast_model_type", "True", TypeError, "initialize(cast_model_type=True)"),
    I("patch_torch_functions", "'maybe'", TypeError, "initialize(patch_torch_functions='maybe')"),
    I("patch_torch_functions", "1", TypeError, "initialize(patch_torch_functions=1)"),
    I("keep_batchnorm_fp32", "'maybe'", TypeError, "initialize(keep_batchnorm_fp32='maybe')"),
    I("keep_batchnorm_fp32", "'true'", TypeError, "initialize(keep_batchnorm_fp32='true')"),
    I("master_weights", "-1", TypeError, "initialize(master_weights=-1)"),
    I("master_weights", "'True'", TypeError, "initialize(master_weights='True')"),
    I("loss_scale", "'fast'", ValueError, "initialize(loss_scale='fast')"),
    I("loss_scale", "-1", ValueError, "initialize(loss_scale=-1)"),
    I("loss_scale", "0", ValueError, "initialize(loss_scale=0)"),
    I("loss_scale", "float('nan')", ValueError, "initialize(loss_scale=nan)"),
    I("loss_scale", "float('inf')", ValueError, "initialize(loss_scale=inf)"),
    I("loss_scale", "True", ValueError, "initialize(loss_scale=True)"),
    I("loss_scale", "'Dynamic'", ValueError, "initialize(loss_scale='Dynamic')"),
    I("half_dtype", "torch.float32", TypeError, "initialize(half_dtype=torch.float32)"),
    I("half_dtype", "'bfloat16'", TypeError, "initialize(half_dtype='bfloat16')"),
    I("cast_model_outputs", "torch.int32", TypeError, "initialize(cast_model_outputs=torch.int32)"),
    I("low_precision_layernorm", "'maybe'", TypeError, "initialize(low_precision_layernorm='maybe')"),
    I("num_losses", "0", ValueError, "initialize(num_losses=0)"),
    I("num_losses", "1.5", ValueError, "initialize(num_losses=1.5)"),
    I("verbosity", "5", ValueError, "initialize(verbosity=5)"),
    I("min_loss_scale", "0", ValueError, "initialize(min_loss_scale=0)"),
    I("min_loss_scale", "float('nan')", ValueError, "initialize(min_loss_scale=nan)"),
    I("max_loss_scale", "float('inf')", ValueError, "initialize(max_loss_scale=inf)"),
    I("max_loss_scale", "-1", ValueError, "initialize(max_loss_scale=-1)"),
    Row("min_loss_scale", "2.**20 with max_loss_scale=2.**16", raw,
        initialize(min_loss_scale=2.0**20, max_loss_scale=2.0**16), ValueError,
        "initialize(min_loss_scale=1048576.0): must not exceed max_loss_scale"),
    I("loss_scale", "1e39 (inf in float32)", ValueError, "initialize(loss_scale=1e+39): expected \"dynamic\", a positive finite number that float32 holds", call=initialize(loss_scale=1e39)),
    I("loss_scale", "1e-39 (a float32 subnormal)", ValueError, "initialize(loss_scale=1e-39)", call=initialize(loss_scale=1e-39)),
    I("min_loss_scale", "1e-40", ValueError, "initialize(min_loss_scale=1e-40): expected a positive finite number that float32 holds"),
    I("max_loss_scale", "1e39", ValueError, "initialize(max_loss_scale=1e+39): expected a positive finite number that float32 holds"),
    I("loss_scale_hysteresis", "0", ValueError, "initialize(loss_scale_hysteresis=0)"),
    I("enabled", "'yes'", TypeError, "initialize(enabled='yes')"),
    I("enabled", "'O2' (initialize(model, optimizer, 'O2'))", TypeError,
      "the third positional argument is `enabled`; pass the level as opt_level='O2'",
      call=lambda e: ampkit.initialize(e.model, e.opt, "O2")),
    I("ddp", "'yes'", TypeError, "initialize(ddp='yes')"),
    I("ddp", "True", RuntimeError, "initialize(ddp=True): the default process group is not initialized"),
    I("ddp_kwargs", "[]", TypeError, "initialize(ddp_kwargs=[])"),
    I("fsdp", "'yes'", TypeError, "initialize(fsdp='yes')"),
    I("fsdp", "True", RuntimeError, "initialize(fsdp=True): the default process group is not initialized"),
    I("fsdp_kwargs", "{}", ValueError, "initialize(fsdp_kwargs=...): only used with fsdp=True"),
    Row("fast", "1 (unknown keyword)", raw, initialize(fast=1), TypeError, "unexpected keyword argument 'fast'"),
    Row("optimizer_state_dtype", "'8-bit' at O8", raw, initialize(opt_level="O8", optimizer_state_dtype="8-bit"),
        TypeError, "initialize(optimizer_state_dtype='8-bit'): expected torch.float32, torch.bfloat16, '8bit'"),
    Row("optimizer_state_dtype", "'8bit' at O5 (fp32 masters)", raw, initialize(opt_level="O5", optimizer_state_dtype="8bit"),
        ValueError, "initialize(optimizer_state_dtype='8bit'): 8-bit optimizer state needs the transient fp32 update"),
    Row("cast_model_type", "torch.bfloat16 at O1 (autocast float16)", raw,
        initialize(opt_level="O1", cast_model_type=torch.bfloat16), ValueError,
        "initialize(cast_model_type=torch.bfloat16): conflicts with half_dtype=torch.float16"),
    # models and optimizers
    Row("models", "'model' (a string)", raw, lambda e: ampkit.initialize("model", e.opt, opt_level="O2"),
        TypeError, "initialize(models=...): expected an nn.Module"),
    Row("models", "[] (empty)", raw, lambda e: ampkit.initialize([], e.opt, opt_level="O2"),
        ValueError, "initialize(models=...): expected at least one model"),
    Row("models", "nn.DataParallel(model)", raw,
        lambda e: ampkit.initialize(nn.DataParallel(e.model), e.opt, opt_level="O2"),
        RuntimeError, "already wrapped in torch.nn.parallel.data_parallel.DataParallel"),
    Row("models", "DistributedDataParallel(model)", ddp_wrapped,
        lambda e: ampkit.initialize(e.model, e.opt, opt_level="O2"),
        RuntimeError, "already wrapped in torch.nn.parallel.distributed.DistributedDataParallel"),
    Row("models", "[model, model]", raw, lambda e: ampkit.initialize([e.model, e.model], e.opt, opt_level="O2"),
        ValueError, "the same model appears twice"),
    Row("models", "a parameter holding NaN", nan_weight, initialize(opt_level="O2"),
        ValueError, "parameter fc2.weight already holds inf/NaN values"),
    Row("models", "nn.Embedding(sparse=True) at O2 (float16 on CPU)", sparse_embedding,
        lambda e: ampkit.initialize(e.others[0], torch.optim.SGD(e.others[0].parameters(), lr=0.1), opt_level="O2"),
        ValueError, "0.weight has sparse gradients (sparse=True), and PyTorch cannot add sparse torch.float16 gradients on cpu"),
    Row("models", "nn.Embedding(sparse=True) at O7", sparse_embedding,
        lambda e: ampkit.initialize(e.others[0], torch.optim.SGD(e.others[0].parameters(), lr=0.1), opt_level="O7"),
        ValueError, "0.weight has sparse gradients (sparse=True), which update_rounding='stochastic' (O7) cannot apply"),
    Row("models", "nn.Embedding(sparse=True) with master_weights='remainder'", sparse_embedding,
        lambda e: ampkit.initialize(e.others[0], torch.optim.SGD(e.others[0].parameters(), lr=0.1), opt_level="O5",
                                    master_weights="remainder"),
        ValueError, "0.weight has sparse gradients (sparse=True), which master_weights='remainder' cannot apply"),
    Row("models", "a model on the meta device", on_meta, initialize(opt_level="O1"),
        RuntimeError, "fc1.weight is on the meta device; materialize the model first"),
    Row("models", "model already initialized (second initialize)", init, initialize(opt_level="O2"),
        RuntimeError, "model was already passed through ampkit.initialize"),
    Row("optimizers", "optimizer already initialized, new model", with_other,
        lambda e: ampkit.initialize(e.others[0], e.opt, opt_level="O2"),
        RuntimeError, "optimizer was already passed through ampkit.initialize"),
    Row("optimizers", "[opt, opt]", raw, lambda e: ampkit.initialize(e.model, [e.opt, e.opt], opt_level="O2"),
        ValueError, "the same optimizer appears twice"),
    Row("optimizers", "'sgd' (a string)", raw, lambda e: ampkit.initialize(e.model, "sgd", opt_level="O2"),
        TypeError, "initialize(optimizers=...): expected a torch.optim.Optimizer"),
    Row("optimizers", "holds parameters of no model passed", with_foreign_param, initialize(opt_level="O2"),
        ValueError, "holds 2 parameter(s) that belong to none of the models"),
    Row("optimizers", "torch.optim.LBFGS (step needs a closure)", lbfgs, initialize(opt_level="O2"),
        ValueError, "LBFGS.step(closure) needs a closure"),
    # scale_loss
    *[Row("loss_id", v, lambda: init("O2"), scaled_step(mse, loss_id=eval(v)), ValueError,
          f"scale_loss(loss_id={v}): expected an integer in [0, 0]", where="scale_loss")
      for v in ("1", "-1", "'0'", "True")],
    Row("loss", "shape (16, 3) (not reduced)", lambda: init("O2"), scaled_step(lambda e: e.model(e.x)), ValueError,
        "scale_loss(loss=...): expected a scalar (one-element) tensor, got (16, 3)", where="scale_loss"),
    Row("loss", "1.0 (a Python float)", lambda: init("O2"), scaled_step(lambda e: 1.0), ValueError,
        "scale_loss(loss=...): expected a scalar (one-element) tensor, got float", where="scale_loss"),
    Row("loss", "NaN (from a NaN in the batch)", lambda: init("O2", verbosity=1), scaled_step(nan_loss), None,
        "no exception: the step is skipped, logged as a gradient overflow; a dynamic scale backs off",
        check=skipped_once, changes={"amp"}, where="scale_loss"),
    Row("loss", "inf", lambda: init("O5", verbosity=1), scaled_step(inf_loss), None,
        "no exception: the step is skipped, logged as a gradient overflow", check=skipped_once, where="scale_loss"),
    Row("optimizers", "an optimizer that skipped initialize", raw, scaled_step(mse), RuntimeError,
        "did not go through ampkit.initialize", where="scale_loss"),
    Row("optimizers", "the model instead of the optimizer", lambda: init("O2"),
        lambda e: ampkit.scale_loss(mse(e), e.model).__enter__(), TypeError,
        "scale_loss(optimizers=...): expected an optimizer or a list of optimizers, got Tiny", where="scale_loss"),
    Row("optimizers", "optimizers of two initialize calls", two_sessions,
        lambda e: ampkit.scale_loss(mse(e), [e.opt, e.o2]).__enter__(), RuntimeError,
        "the optimizers come from different ampkit.initialize calls", where="scale_loss"),
    Row("loss_id", "1 while loss 0's delay_unscale window is open", open_window,
        lambda e: ampkit.scale_loss(mse(e), e.opt, loss_id=1).__enter__(), RuntimeError, "still holds gradients scaled by another loss's scaler", where="scale_loss"),
    Row("optimizers", "one the loss does not reach (another run's)", two_sessions,
        lambda e: scaled_step(mse)(Env(e.model, e.o2, e.x, e.y)), RuntimeError,
        "the backward inside the block reached none of the parameters of SGD (4 parameters)",
        changes={"model.grads"}, where="scale_loss"),
    Row("delay_unscale", "'yes'", lambda: init("O2"), scaled_step(mse, delay_unscale="yes"), TypeError,
        "scale_loss(delay_unscale='yes'): expected True or False", where="scale_loss"),
    Row("optimizer.step()", "inside the scale_loss block", lambda: init("O2"), step_inside_block, RuntimeError,
        "SGD.step() was called inside `with ampkit.scale_loss(...)`", changes={"model.grads"}, where="scale_loss"),
    Row("optimizers", "the optimizer of an enclosing scale_loss block (nested)", lambda: init("O2"),
        nested_scale_loss, RuntimeError, "is already inside an enclosing `with ampkit.scale_loss(...)` block",
        where="scale_loss"),
    # optimizer
    Row("optimizer.step()", "before any backward, O2", lambda: init("O2", "adamw"), lambda e: e.opt.step(), None,
        "no exception: nothing to apply, nothing changes (Apex crashed here)", where="optimizer"),
    Row("optimizer.step()", "before any backward, O5", lambda: init("O5", "adamw"), lambda e: e.opt.step(), None,
        "no exception: nothing to apply, nothing changes (Apex crashed here)", where="optimizer"),
    *[Row("optimizer.step()", f"after a plain loss.backward() with NaN, {level}", lambda level=level: init(level, "adamw", verbosity=1),
          plain_nan_backward_then_step, None, "no exception: the step is skipped, logged as a gradient overflow outside "
          "scale_loss", check=skipped_once, where="optimizer") for level in ("O0", "O4", "O7", "O8")],
    Row("models", "the optimizer (arguments swapped)", lambda: init("O2"),
        lambda e: footprint.persistent_bytes(e.opt, e.model), TypeError, "persistent_bytes(models=...): expected an "
        "nn.Module or a list of them, got SGD (the arguments are models, optimizers: swapped?)",
        where="ampkit.footprint.persistent_bytes"),
    Row("optimizers", "None", lambda: init("O2"), lambda e: footprint.persistent_bytes(e.model, None), TypeError,
        "persistent_bytes(optimizers=...): expected an optimizer or a list of them, got NoneType",
        where="ampkit.footprint.persistent_bytes"),
    Row("models", "a model without parameters", lambda: init("O2"),
        lambda e: footprint.bytes_per_param([nn.ReLU()], [e.opt]), ValueError,
        "bytes_per_param(models=...): the models hold no parameters", where="ampkit.footprint.bytes_per_param"),
    Row("closure", "lambda: loss", lambda: init("O2"), lambda e: e.opt.step(lambda: mse(e)), RuntimeError,
        "optimizer.step(closure): closures are not supported by ampkit", where="optimizer"),
    Row("model", "model.float() after initialize (O2), then forward", cast_after_initialize,
        lambda e: e.model(e.x), RuntimeError, "was cast after ampkit.initialize", where="model.forward"),
    Row("params", "a set", with_other, lambda e: e.opt.add_param_group({"params": set(e.others[0].parameters())}),
        TypeError, "add_param_group(params=set)", where="optimizer"),
    # state dicts and checkpoints
    Row("state", "2 loss scalers, num_losses=1", lambda: init("O2"),
        amp_load({"loss_scaler0": _scaler(), "loss_scaler1": _scaler()}), ValueError,
        "holds 2 loss scaler(s)", where="ampkit.load_state_dict"),
    Row("state", "'x' (not a dict)", lambda: init("O2"), amp_load("x"), TypeError,
        "ampkit.load_state_dict(state): expected a dict, got str", where="ampkit.load_state_dict"),
    Row("state", "key 'scaler0'", lambda: init("O2"), amp_load({"scaler0": _scaler()}), ValueError,
        "unexpected key(s) ['scaler0']", where="ampkit.load_state_dict"),
    Row("state", "loss_scale=-1", lambda: init("O2"), amp_load({"loss_scaler0": _scaler(-1.0)}), ValueError,
        "loss_scaler0['loss_scale']=-1.0: expected a positive finite number", where="ampkit.load_state_dict"),
    Row("state", "loss_scale=1e-300 (0 in float32)", lambda: init("O2"), amp_load({"loss_scaler0": _scaler(1e-300)}),
        ValueError, "loss_scaler0['loss_scale']=1e-300: expected a positive finite number that float32 holds",
        where="ampkit.load_state_dict"),
    Row("optimizer", "the model instead", lambda: init("O2"), lambda e: ampkit.state_dict(optimizer=e.model), TypeError,
        "ampkit.state_dict(): optimizer= expects an optimizer returned by ampkit.initialize, got a Tiny (an nn.Module: "
        "pass it as model=...)", where="ampkit.state_dict"),
    Row("optimizer", "the model instead", lambda: init("O2"),
        lambda e: ampkit.load_state_dict({"loss_scaler0": _scaler()}, optimizer=e.model), TypeError,
        "ampkit.load_state_dict(): optimizer= expects an optimizer returned by ampkit.initialize, got a Tiny",
        where="ampkit.load_state_dict"),
    Row("optimizer", "the model instead", lambda: init("O2"), lambda e: ampkit.loss_scalers(e.model), TypeError,
        "ampkit.loss_scalers(): optimizer= expects an optimizer returned by ampkit.initialize, got a Tiny",
        where="ampkit.loss_scalers"),
    Row("optimizer", "the model instead", lambda: init("O2"), lambda e: ampkit.step_was_skipped(e.model), TypeError,
        "ampkit.step_was_skipped(): optimizer= expects an optimizer returned by ampkit.initialize, got a Tiny",
        where="ampkit.step_was_skipped"),
    Row("model", "the optimizer instead", lambda: init("O2"), lambda e: ampkit.state_dict(model=e.opt), TypeError,
        "ampkit.state_dict(): model= expects an nn.Module prepared by ampkit.initialize, got a SGD",
        where="ampkit.state_dict"),
    Row("optimizer", "an optimizer that skipped initialize", lambda: init("O2"),
        lambda e: ampkit.state_dict(optimizer=torch.optim.SGD(e.model.parameters(), lr=0.1)), ValueError,
        "ampkit.state_dict(): optimizer=SGD did not go through ampkit.initialize", where="ampkit.state_dict"),
    Row("state", "consecutive_overflows='x' in loss_scaler1", lambda: init("O2", num_losses=2, loss_scale_hysteresis=2),
        amp_load({"loss_scaler0": _scaler(), "loss_scaler1": _scaler(consecutive_overflows="x")}), ValueError,
        "loss_scaler1['consecutive_overflows']='x'", where="ampkit.load_state_dict"),
    Row("optimizer", "model and optimizer swapped", with_checkpoint("plain"),
        lambda e: checkpoint.save(e.tmp / "c.pt", e.opt, e.model), TypeError,
        "ampkit.checkpoint.save(model=...): expected an nn.Module, got a SGD (the arguments are path, model, optimizer: swapped?)",
        where="ampkit.checkpoint.save"),
    Row("state_dict", "fc1.weight holding NaN", lambda: init("O5"),
        model_load(lambda sd: sd["fc1.weight"].__setitem__((0, 0), float("nan"))), ValueError,
        "Tiny.load_state_dict: fc1.weight holds inf/NaN values", where="model.load_state_dict"),
    Row("state_dict", "missing key fc2.bias", lambda: init("O2"), model_load(lambda sd: sd.pop("fc2.bias")),
        RuntimeError, 'Missing key(s) in state_dict: "fc2.bias"', where="model.load_state_dict"),
    Row("state_dict", "extra key", lambda: init("O2"), model_load(lambda sd: sd.update(extra=torch.zeros(1))),
        RuntimeError, 'Unexpected key(s) in state_dict: "extra"', where="model.load_state_dict"),
    Row("state_dict", "fc1.weight of shape (7, 4)", lambda: init("O5"),
        model_load(lambda sd: sd.update({"fc1.weight": torch.zeros(7, 4)})), RuntimeError,
        "size mismatch for fc1.weight", where="model.load_state_dict"),
    Row("state_dict", "another optimizer's layout (2 groups)", lambda: init("O2", "adamw"), opt_from_other_layout,
        ValueError, "loaded state dict has a different number of parameter groups", where="optimizer.load_state_dict"),
    Row("extra", "{'out': pathlib.Path(...)}", with_checkpoint("plain"),
        lambda e: checkpoint.save(e.tmp / "new.ckpt", e.model, e.opt, extra={"out": Path("/tmp/run")}), TypeError,
        "extra['out'] is a pathlib.PosixPath, which torch.load(..., weights_only=True)", where="ampkit.checkpoint.save"),
    Row("extra", "{'args': argparse.Namespace(...)}", with_checkpoint("plain"),
        lambda e: checkpoint.save(e.tmp / "new.ckpt", e.model, e.opt, extra={"args": argparse.Namespace(lr=0.1)}),
        TypeError, "extra['args'] is a argparse.Namespace", where="ampkit.checkpoint.save"),
    Row("path", "a truncated file", with_checkpoint("truncated"),
        lambda e: checkpoint.load(e.tmp / "c.ckpt", e.model, e.opt), CheckpointError,
        "truncated or corrupted?", where="ampkit.checkpoint.load"),
    Row("path", "a plain torch.save(model.state_dict())", with_checkpoint("plain"),
        lambda e: checkpoint.load(e.tmp / "c.ckpt", e.model, e.opt), CheckpointError,
        "not an ampkit checkpoint", where="ampkit.checkpoint.load"),
    Row("path", "a checkpoint written with AdamW, loaded into SGD", with_checkpoint("adamw"),
        lambda e: checkpoint.load(e.tmp / "c.ckpt", e.model, e.opt), CheckpointError,
        "optimizer state was written by torch.optim.adamw.AdamW; this optimizer is torch.optim.sgd.SGD",
        where="ampkit.checkpoint.load"),
    Row("path", "a checkpoint of num_losses=2", with_checkpoint("two-losses"),
        lambda e: checkpoint.load(e.tmp / "c.ckpt", e.model, e.opt), CheckpointError,
        "initialize was called with num_losses=1", where="ampkit.checkpoint.load"),
]


def _state(e: Env) -> dict:
    snap = snapshot(e.model, e.opt, grads=True)
    st = getattr(e.opt, "_ampkit", None)
    if st is not None:
        snap["amp"] = [repr(s.state_dict()) for s in st.run.scalers]
    for i, m in enumerate(e.others):
        snap.update({f"other{i}.{k}": v for k, v in snapshot(m, grads=True).items()})
    return snap


def _still_usable(e: Env):
    model = e.others[0] if isinstance(e.model, nn.parallel.DistributedDataParallel) else e.model
    if model.fc1.weight.device.type == "meta":
        model.to_empty(device="cpu")
        for m in model.modules():
            if isinstance(m, nn.Linear):
                m.reset_parameters()
        e.opt = torch.optim.SGD(model.parameters(), lr=0.1)
    params = {id(p) for p in model.parameters()}
    if any(id(p) not in params for g in e.opt.param_groups for p in g["params"]) and not hasattr(e.opt, "_ampkit"):
        e.opt = torch.optim.SGD(model.parameters(), lr=0.1)  # the foreign-parameter optimizer
    if getattr(getattr(model, "_ampkit", None), "dtype_error", None):  # cast after initialize: start over
        model, e.opt = make()
        model, e.opt = ampkit.initialize(model, e.opt, opt_level="O2", verbosity=0)
    if not all_finite(model):
        with torch.no_grad():
            for p in model.parameters():
                p.nan_to_num_(0.0)
    if isinstance(e.opt, torch.optim.LBFGS):
        e.opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if not hasattr(model, "_ampkit"):
        model, e.opt = ampkit.initialize(model, e.opt, opt_level="O2", verbosity=0)
    elif getattr(e, "window_open", False):
        e.opt.zero_grad()
    before = snapshot(model, e.opt)
    with ampkit.scale_loss(LOSSES[0](model(e.x), e.y), e.opt) as s:
        s.backward()
    e.opt.step()
    assert "opt.params" in diff(before, snapshot(model, e.opt)) and all_finite(model, e.opt)


@pytest.mark.parametrize("row", TABLE, ids=[r.id for r in TABLE])
def test_bad_input(row: Row, caplog):
    e = row.setup()
    try:
        _check_row(row, e, caplog)
    finally:
        if e.tmp is not None:
            shutil.rmtree(e.tmp, ignore_errors=True)


def _check_row(row: Row, e: Env, caplog):
    before = _state(e)
    with caplog.at_level(logging.INFO, logger="ampkit"):
        if row.exc is None:
            row.call(e)
        else:
            with pytest.raises(row.exc) as err:
                row.call(e)
            assert row.message in str(err.value), f"message lacks {row.message!r}:\n{err.value}"
    after = _state(e)
    for key in row.changes:
        before.pop(key), after.pop(key)
    assert_unchanged(before, after, f"after {row.id}")
    if row.check is not None:
        row.check(e)
        assert any("Gradient overflow" in r.getMessage() for r in caplog.records)
    _still_usable(e)


def render_markdown() -> str:
    lines = [
        "# Bad inputs: what a user sees",
        "",
        "Generated from `tests/reliability/test_bad_inputs.py` (each row is a test: the exception, a",
        "message fragment, and model/optimizer/loss scalers bit-identical and still usable afterwards).",
        "Rows without an exception must work.",
        "",
        "<!-- --8<-- [start:table] -->",
        "| call | argument | bad value | exception | message (contains) |",
        "|---|---|---|---|---|",
    ]
    for r in TABLE:
        exc = r.exc.__name__ if r.exc else "none"
        cells = [f"`{r.where}`", f"`{r.argument}`", r.value, exc, r.message]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    lines += ["", f"{len(TABLE)} bad inputs.", "<!-- --8<-- [end:table] -->", ""]
    return "\n".join(lines)


def test_bad_inputs_md_matches_the_table():
    text = render_markdown()
    if os.environ.get("AMPKIT_WRITE_BAD_INPUTS"):
        MD.write_text(text)
    assert MD.read_text() == text, "BAD_INPUTS.md is stale: rerun with AMPKIT_WRITE_BAD_INPUTS=1"


@pytest.mark.repo_files("docs/troubleshooting.md")
def test_the_docs_include_the_table():
    """The troubleshooting page includes this file's table section (pymdownx.snippets), so it shows these rows."""
    page = (Path(__file__).parents[2] / "docs" / "troubleshooting.md").read_text()
    assert '\n--8<-- "tests/reliability/BAD_INPUTS.md:table"\n' in page
    assert "[start:table]" in MD.read_text() and "[end:table]" in MD.read_text()
