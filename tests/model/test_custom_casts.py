"""User-registered casts (the O1/O4 op lists, made extensible): half, float and promote
functions, registered or decorated, checked by the dtypes they receive inside ampkit's
autocast region (the model's forward, ``ampkit.autocast()``) and unchanged outside it."""
import types

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import ampkit

HALF = {"O1": torch.float16, "O4": torch.bfloat16}
OTHER_HALF = {"O1": torch.bfloat16, "O4": torch.float16}
TORCH_NAMES = [(torch, "sigmoid"), (torch, "dot"), (F, "gelu"), (torch, "tanh")]


@pytest.fixture(autouse=True)
def restore_torch_functions():
    """Whatever a test registers on torch modules is put back, so other tests see plain torch."""
    saved = [(mod, name, getattr(mod, name)) for mod, name in TORCH_NAMES]
    yield
    for mod, name, fn in saved:
        setattr(mod, name, fn)


class Spy:
    """A module namespace whose functions record what they were called with."""

    def __init__(self):
        self.calls = []
        self.mod = types.ModuleType("spy_ops")
        for name in ("half_op", "float_op", "promote_op"):
            setattr(self.mod, name, self._recorder(name))

    def _recorder(self, name):
        def op(*args, **kwargs):
            self.calls.append({
                "args": args,
                "kwargs": kwargs,
                "autocast": torch.is_autocast_enabled("cpu"),
                "mm": torch.mm(torch.ones(1, 1), torch.ones(1, 1)).dtype,  # what autocast does inside
            })
            return args[0] if args else None

        op.__name__ = name
        return op

    @property
    def last(self):
        return self.calls[-1]


class Caller(nn.Module):
    """Runs ``fn(*args, **kwargs)`` inside its (ampkit-wrapped) forward."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def forward(self, fn, *args, **kwargs):
        fn(*args, **kwargs)
        return self.lin(torch.ones(1, 2))


def region_runner(level, where):
    """A function ``run(fn, *args, **kwargs)`` calling fn inside ampkit's autocast region."""
    model = ampkit.initialize(Caller(), opt_level=level, verbosity=0)
    if where == "model":
        return model

    def run(fn, *args, **kwargs):
        with ampkit.autocast():
            fn(*args, **kwargs)

    return run


def dtypes(call):
    def walk(obj):
        if torch.is_tensor(obj):
            return obj.dtype
        if isinstance(obj, (list, tuple)):
            return type(obj)(walk(o) for o in obj)
        if isinstance(obj, dict):
            return {k: walk(v) for k, v in obj.items()}
        return obj

    return walk(call["args"]), walk(call["kwargs"])


def sample_args(level):
    f32, half = torch.randn(3), torch.randn(3).to(HALF[level])
    idx = torch.arange(3)
    return (f32, half, idx, [f32, (half,)], 2.5), {"w": f32, "flag": True}


LEVEL_WHERE = [(level, where) for level in ("O1", "O4") for where in ("model", "autocast")]


@pytest.mark.parametrize("level,where", LEVEL_WHERE)
def test_half_function_gets_half_floating_arguments(level, where):
    spy = Spy()
    ampkit.register_half_function(spy.mod, "half_op")
    run = region_runner(level, where)
    args, kwargs = sample_args(level)
    run(spy.mod.half_op, *args, **kwargs)
    h = HALF[level]
    assert dtypes(spy.last) == ((h, h, torch.int64, [h, (h,)], 2.5), {"w": h, "flag": True})
    assert torch.equal(spy.last["args"][0], args[0].to(h))  # a cast, values kept (rounded)


@pytest.mark.parametrize("level,where", LEVEL_WHERE)
def test_float_function_gets_float32_arguments_without_autocast(level, where):
    spy = Spy()
    ampkit.register_float_function(spy.mod, "float_op")
    run = region_runner(level, where)
    args, kwargs = sample_args(level)
    run(spy.mod.float_op, *args, **kwargs)
    f = torch.float32
    assert dtypes(spy.last) == ((f, f, torch.int64, [f, (f,)], 2.5), {"w": f, "flag": True})
    assert spy.last["autocast"] is False and spy.last["mm"] == torch.float32  # autocast off inside
    assert torch.equal(spy.last["args"][1], args[1].float())


@pytest.mark.parametrize("level,where", LEVEL_WHERE)
def test_promote_function_promotes_to_the_widest_floating_dtype(level, where):
    spy = Spy()
    ampkit.register_promote_function(spy.mod, "promote_op")
    run = region_runner(level, where)
    h, other = torch.ones(2, dtype=HALF[level]), torch.ones(2, dtype=OTHER_HALF[level])
    f32, f64, idx = torch.ones(2), torch.ones(2, dtype=torch.float64), torch.arange(2)

    run(spy.mod.promote_op, h, f32, idx)
    assert dtypes(spy.last)[0] == (torch.float32, torch.float32, torch.int64)
    run(spy.mod.promote_op, h, h)
    assert dtypes(spy.last)[0] == (HALF[level], HALF[level])  # nothing to promote
    run(spy.mod.promote_op, h, other)  # float16 with bfloat16: float32 holds both
    assert dtypes(spy.last)[0] == (torch.float32, torch.float32)
    run(spy.mod.promote_op, h, [f32], y=f64)
    assert dtypes(spy.last) == ((torch.float64, [torch.float64]), {"y": torch.float64})


@pytest.mark.parametrize("kind", ["half", "float", "promote"])
def test_outside_the_region_functions_behave_exactly_as_the_original(kind):
    spy = Spy()
    getattr(ampkit, f"register_{kind}_function")(spy.mod, f"{kind}_op")
    fn = getattr(spy.mod, f"{kind}_op")
    f32, h = torch.randn(3), torch.randn(3).half()

    def check(call_in):
        spy.calls.clear()
        result = call_in(lambda: fn(f32, h, k=f32))
        assert result is f32  # the original's result, the caller's own tensor objects
        assert spy.last["args"][0] is f32 and spy.last["args"][1] is h and spy.last["kwargs"]["k"] is f32

    check(lambda call: call())  # no autocast region at all
    ampkit.initialize(Caller(), opt_level="O2", verbosity=0)  # O2: ampkit.autocast() is a no-op

    def in_noop_autocast(call):
        with ampkit.autocast():
            return call()

    check(in_noop_autocast)
    ampkit.initialize(Caller(), opt_level="O1", verbosity=0)

    def in_disabled_region(call):
        with ampkit.autocast(), ampkit.disable_casts():
            return call()

    check(in_disabled_region)

    def in_autocast_disabled_arg(call):
        with ampkit.autocast(enabled=False):
            return call()

    check(in_autocast_disabled_arg)


def test_decorators():
    seen = []

    @ampkit.half_function
    def h(x, y):
        """doc"""
        seen.append((x.dtype, y.dtype))
        return x

    @ampkit.float_function
    def f(x):
        seen.append((x.dtype, torch.is_autocast_enabled("cpu")))
        return x

    @ampkit.promote_function
    def p(x, y):
        seen.append((x.dtype, y.dtype))
        return x

    assert h.__name__ == "h" and h.__doc__ == "doc" and h.__wrapped__ is not None
    x32, x16 = torch.ones(2), torch.ones(2).half()
    h(x32, x16)
    f(x16)
    p(x16, x32)
    assert seen == [(torch.float32, torch.float16), (torch.float16, False), (torch.float16, torch.float32)]
    seen.clear()
    ampkit.initialize(Caller(), opt_level="O4", verbosity=0)
    with ampkit.autocast():
        h(x32, x16)
        f(x16)
        p(x16, x32)
    assert seen == [(torch.bfloat16, torch.bfloat16), (torch.float32, False), (torch.float32, torch.float32)]


def test_registered_torch_functions_inside_an_initialized_model():
    """The Apex recipe: register before (or after) initialize; torch itself is restored by the fixture."""
    original_sigmoid, original_gelu, original_dot = torch.sigmoid, F.gelu, torch.dot
    ampkit.register_float_function(torch, "sigmoid")  # native CPU autocast would keep half here
    ampkit.register_half_function(F, "gelu")  # native CPU autocast runs gelu in float32
    ampkit.register_promote_function(torch, "dot")  # torch.dot refuses mixed dtypes by itself
    assert torch.sigmoid.__wrapped__ is original_sigmoid and F.gelu.__wrapped__ is original_gelu

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.seen = {}

        def forward(self, x):
            h = self.lin(x)  # float16 under O1's autocast
            self.seen["lin"] = h.dtype
            self.seen["sigmoid"] = torch.sigmoid(h).dtype
            self.seen["gelu"] = F.gelu(x).dtype
            self.seen["dot"] = torch.dot(h[0], x[0]).dtype
            return F.gelu(h).sum()

    model = Net()
    model, opt = ampkit.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O1", verbosity=0)
    ampkit.load_state_dict({"loss_scaler0": {"loss_scale": 8.0, "unskipped": 0}})  # 2**16 overflows here
    x = torch.randn(2, 4, requires_grad=True)
    out = model(x)
    assert model.seen == {"lin": torch.float16, "sigmoid": torch.float32, "gelu": torch.float16, "dot": torch.float32}
    with ampkit.scale_loss(out, opt) as scaled:
        scaled.backward()
    assert x.grad.dtype == torch.float32 and model.lin.weight.grad.dtype == torch.float32
    assert torch.isfinite(model.lin.weight.grad).all()
    # Outside the region: exactly torch's own behaviour.
    h = torch.randn(3).half()
    assert torch.sigmoid(h).dtype == torch.float16 and torch.equal(torch.sigmoid(h), original_sigmoid(h))
    assert F.gelu(torch.randn(3)).dtype == torch.float32
    with pytest.raises(RuntimeError):
        torch.dot(h, torch.randn(3))
    with pytest.raises(RuntimeError):
        original_dot(h, torch.randn(3))


def test_registering_again_rewraps_the_original():
    spy = Spy()
    original = spy.mod.half_op
    ampkit.register_half_function(spy.mod, "half_op")
    ampkit.register_float_function(spy.mod, "half_op")
    assert spy.mod.half_op.__wrapped__ is original  # not a wrapper around a wrapper
    ampkit.initialize(Caller(), opt_level="O1", verbosity=0)
    with ampkit.autocast():
        spy.mod.half_op(torch.ones(2).half())
    assert dtypes(spy.last)[0] == (torch.float32,)


def test_registering_a_missing_name_is_a_clear_error():
    spy = Spy()
    with pytest.raises(ValueError, match=r"No function named 'nope' in module 'spy_ops'"):
        ampkit.register_half_function(spy.mod, "nope")
    assert not hasattr(spy.mod, "nope")
    with pytest.raises(ValueError, match=r"No function named 'sigmoidd' in module 'torch'"):
        ampkit.register_float_function(torch, "sigmoidd")
    assert not hasattr(torch, "sigmoidd")
    with pytest.raises(ValueError, match="No function named 3"):
        ampkit.register_promote_function(spy.mod, 3)
    spy.mod.constant = 1.5
    with pytest.raises(TypeError, match="spy_ops.constant is not callable"):
        ampkit.register_half_function(spy.mod, "constant")
    assert spy.mod.constant == 1.5
