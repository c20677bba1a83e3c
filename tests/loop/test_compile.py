"""torch.compile over an initialized model and its optimizer step, at every opt level.

At O7 only the model is compiled in the per-level cases: its transient update swaps fresh float32
copies into the optimizer's param_groups every step for what the fused AdamW does not take (so a
compiled ``torch.optim`` step recompiles every step until Dynamo's recompile limit). The fused
updates are declared ops (``ampkit::adamw_bf16``, ``adamw_master``, ``adamw_remainder``,
``adamw_8bit``): a compiled O7 step runs its op with the eager step's bits, and each op
compiles alone into one graph (the last tests).

Compiles are expensive here (tens of seconds each with inductor), so the per-level cases
use the ``aot_eager`` backend: it traces the forward with Dynamo (``fullgraph=True``, so
any graph break fails) and the backward with AOTAutograd, which is where ampkit's code
could break a graph; one case runs the whole documented pattern through inductor.
"""
import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.utils import counters

import ampkit
from ampkit import float8

STEPS = 50
# Loss-curve tolerance per level: the compiled graph may reorder or fuse half arithmetic.
TOL = {"O0": 1e-5, "O1": 5e-3, "O2": 5e-3, "O3": 5e-3, "O4": 3e-2, "O5": 3e-2, "O6": 3e-2, "O7": 3e-2}
# Final weights: AdamW moves a weight whose gradient is near zero by about lr whatever its sign,
# so one half-precision rounding difference can move a single weight by a step or two; fp8's
# 3-bit mantissa at O6 moves one weight of 512 by up to 0.06 (aot_eager) or 0.10 (inductor).
STATE_ATOL = {"O0": 1e-5, "O1": 2e-2, "O2": 2e-2, "O3": 2e-2, "O4": 5e-2, "O5": 5e-2, "O6": 2e-1, "O7": 5e-2}
INF_STEP = 20  # a batch with an inf: every level must skip this step, compiled or not
EAGER_STEP = {"O7"}  # levels whose documented pattern compiles only the model (module docstring)


class Net(nn.Module):
    """Takes a dict batch (the input-casting path for mappings) and has BatchNorm and LayerNorm;
    ``fc1`` is the one layer that O6 runs in fp8 (16 and 32 features; ``fc2`` is the head)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32, bias=False)  # a bias before BatchNorm gets only noise
        self.bn = nn.BatchNorm1d(32)
        self.ln = nn.LayerNorm(32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, batch):
        return self.fc2(self.ln(torch.relu(self.bn(self.fc1(batch["x"])))))


def _batches(device="cpu"):
    g = torch.Generator().manual_seed(1)
    out = [({"x": torch.randn(16, 16, generator=g).to(device)}, torch.randn(16, 4, generator=g).to(device))
           for _ in range(4)]
    bad = {"x": out[0][0]["x"].clone()}
    bad["x"][0, 0] = float("inf")
    return out, (bad, out[0][1])


def _snapshot(model, opt):
    """What a skipped step must leave as it was: weights, optimizer state, the rounding state."""
    rounder = opt._ampkit.run.rounder
    weights = list(model.parameters()) + [p for g in opt.param_groups for p in g["params"]]  # masters too
    return ([p.detach().clone() for p in weights],
            [v.clone() for st in opt.state.values() for v in st.values() if torch.is_tensor(v)],
            [] if rounder is None else [torch.tensor([rounder.seed, rounder.step])])


def _train(level, backend=None, device="cpu"):
    """Losses, skipped steps and final fp32 state of STEPS steps of the documented loop; the
    skipped step is checked to leave weights, optimizer state and the rounding state as they were."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = Net().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4)  # 1e-8 is 0 in fp16 (O3 steps on it)
    model, opt = ampkit.initialize(model, opt, opt_level=level, verbosity=0)
    forward, step = model, opt.step
    if backend is not None:
        forward = torch.compile(model, fullgraph=True, backend=backend)
    if backend is not None and level not in EAGER_STEP:
        @torch.compile(backend=backend)
        def step():
            opt.step()

    batches, bad = _batches(device)
    losses = []
    for i in range(STEPS):
        x, y = bad if i == INF_STEP else batches[i % len(batches)]
        opt.zero_grad()
        loss = nn.functional.mse_loss(forward(x), y)
        with ampkit.scale_loss(loss, opt) as scaled:
            scaled.backward()
        before = _snapshot(model, opt) if i == INF_STEP else None
        step()
        if before is not None:
            for a, b in zip(before, _snapshot(model, opt)):
                assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
        losses.append(loss.item())
    breaks = dict(counters["graph_break"])
    skipped = opt._ampkit.run.scalers[0].skipped_steps
    return torch.tensor(losses), skipped, {k: v.cpu() for k, v in model.state_dict().items()}, breaks


def _only_torch_optim_breaks(breaks):
    """torch.optim's step breaks its graph on purpose (``torch._dynamo.graph_break()`` around
    the update, so that AOTAutograd sees an inference graph); anything else is a failure."""
    return all(reason.startswith("Call to `torch._dynamo.graph_break()`") for reason in breaks)


# Compiling an optimizer step imports torch.utils.mkldnn (through inductor's passes), whose class
# bodies use torch.jit.script_method: torch's own deprecation, once per process, not ampkit's.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
NEEDS_TORCHAO = pytest.mark.skipif(not float8.available(), reason="O6 needs torchao (pip install -e '.[fp8]')")


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3", "O4", "O5", pytest.param("O6", marks=NEEDS_TORCHAO), "O7"])
def test_compiled_model_and_step_match_eager(level):
    assert float8.eligible(Net()) == ["fc1"]  # O6 runs one fp8 layer
    eager, eager_skipped, eager_state, _ = _train(level)
    compiled, skipped, state, breaks = _train(level, backend="aot_eager")
    assert _only_torch_optim_breaks(breaks), breaks
    assert skipped == eager_skipped >= 1
    assert not torch.isfinite(compiled[INF_STEP]) and not torch.isfinite(eager[INF_STEP])
    finite = torch.isfinite(eager)
    torch.testing.assert_close(compiled[finite], eager[finite], rtol=TOL[level], atol=TOL[level])
    assert eager[finite][-5:].mean() < eager[0]  # it trained
    for key, value in eager_state.items():
        assert state[key].dtype == value.dtype == (torch.int64 if "num_batches" in key else torch.float32)
        # BatchNorm's running statistics took the inf batch in both runs (forward statistics are not skipped).
        torch.testing.assert_close(state[key], value, rtol=TOL[level], atol=STATE_ATOL[level], equal_nan=True)


def test_forward_has_no_graph_break_with_kwargs_and_nested_inputs():
    torch._dynamo.reset()

    class Kw(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x, extra=None, pair=()):
            return {"out": self.fc(x) + extra["b"] + pair[0], "n": pair[1]}

    model = ampkit.initialize(Kw(), opt_level="O5", verbosity=0)
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    x, b, p = torch.randn(2, 4), torch.randn(2, 4), torch.randn(2, 4)
    out = compiled(x, extra={"b": b}, pair=(p, 3))
    ref = model(x, extra={"b": b}, pair=(p, 3))
    assert out["out"].dtype == torch.float32 and out["n"] == 3
    assert torch.equal(out["out"], ref["out"])


@pytest.mark.parametrize("level, device", [
    ("O5", "cpu"),
    pytest.param("O6", "cpu", marks=NEEDS_TORCHAO),
    ("O7", "cpu"),
    pytest.param("O2", "cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")]),
    pytest.param("O5", "cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")]),
])
def test_documented_pattern_through_inductor(level, device):
    """The README's compiled training step (compiled model, eager scale_loss, compiled step; at O7
    an eager step) through the real compiler: inductor's fused kernels round half precision differently, within tolerance."""
    eager, eager_skipped, eager_state, _ = _train(level, device=device)
    compiled, skipped, state, breaks = _train(level, backend="inductor", device=device)
    assert _only_torch_optim_breaks(breaks), breaks
    assert skipped == eager_skipped >= 1
    finite = torch.isfinite(eager)
    assert torch.equal(finite, torch.isfinite(compiled))
    torch.testing.assert_close(compiled[finite], eager[finite], rtol=TOL[level], atol=TOL[level])
    for key, value in eager_state.items():
        assert state[key].dtype == value.dtype
        torch.testing.assert_close(state[key], value, rtol=TOL[level], atol=STATE_ATOL[level], equal_nan=True)


FUSED = {  # the fused paths' initialize arguments and their declared op
    "O7": ({"opt_level": "O7"}, "ampkit::adamw_bf16"),
}


def _fused_weights(level: str, compiled: bool, steps: int = 4):
    """The bits of the bf16 weights, the optimizer state and the remainders (with their side
    tables) after each of ``steps`` steps of a fused path (AdamW), the step compiled or eager, and
    the ops the last step ran (profiled)."""
    from ampkit._kernels.remainder import side_table

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = ampkit.initialize(model, opt, **FUSED[level][0], verbosity=0)
    step = torch.compile(opt.step, backend="aot_eager") if compiled else opt.step
    batches, _ = _batches()
    out = []
    for i in range(steps):
        x, y = batches[i % len(batches)]
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x["x"].bfloat16()).float(), y)
        with ampkit.scale_loss(loss, opt) as scaled:
            scaled.backward()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            step()
        state = [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
        rems = [t for r in model._ampkit.remainders.values() for t in (r, side_table(r))]
        out.append([t.detach().clone() for t in list(model.parameters()) + state + rems])
    return out, [e.name for e in prof.events() if not _tracing(e)]


def _tracing(event) -> bool:
    """Whether a profiled ``event`` ran while Dynamo compiled (an op traced, not run)."""
    while event is not None:
        if event.name == "entire_frame_compile":
            return True
        event = event.cpu_parent
    return False


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


@pytest.mark.parametrize("level", list(FUSED))
def test_a_compiled_fused_step_runs_the_op_with_the_eager_steps_bits(lib, level):
    """Each fused path is a declared op: a compiled step runs it, once per param group, and its
    weights, optimizer state and remainders equal the eager step's bit for bit at every step."""
    eager, eager_ops = _fused_weights(level, False)
    compiled, ops = _fused_weights(level, True)
    assert all(len(a) == len(b) for a, b in zip(eager, compiled))
    assert all(torch.equal(_bits(a), _bits(b)) for step_a, step_b in zip(eager, compiled) for a, b in zip(step_a, step_b))
    assert not all(torch.equal(a, b) for a, b in zip(eager[0][:4], eager[-1][:4]))  # it trained
    op = FUSED[level][1]
    assert ops.count(op) == eager_ops.count(op) == 1  # one call for the group's four tensors
    assert not {"aten::_fused_adamw_", "aten::_foreach_lerp_", "aten::_foreach_addcdiv_"} & set(ops)  # no torch.optim update


def test_the_fused_op_compiles_into_one_graph_with_the_eager_bits(lib):
    """``fullgraph=True``: the op traces (its fake), and five compiled steps equal five eager ones."""
    from ampkit._kernels import ops
    from ampkit._kernels.fused_adamw import Hyper

    def step(w, g, m, v, count, rstep):
        count += 1
        ops.adamw_steps_([(w, g, m, v, count, 3, 0)], Hyper(1e-2, 0.9, 0.999, 1e-8, 0.01, True, False, 0.0), 7, rstep)

    gen = torch.Generator().manual_seed(0)
    runs = [[torch.randn(1000, generator=gen).bfloat16(), torch.randn(1000, generator=gen).bfloat16(),
             torch.zeros(1000), torch.zeros(1000), torch.zeros(())]]
    runs.append([t.clone() for t in runs[0]])
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    for rstep in range(5):
        step(*runs[0], rstep)
        compiled(*runs[1], rstep)
    assert all(torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a, b.view(torch.int16)
                           if b.dtype == torch.bfloat16 else b) for a, b in zip(*runs))
    assert runs[1][4].item() == 5.0 and not torch.equal(runs[1][2], torch.zeros(1000))


def _compiles_as_eager(step, args, steps: int = 5, carry=None, **config):
    """``step(*args, rstep)`` compiled with ``fullgraph=True`` (under Dynamo's ``config``) gives,
    over ``steps`` steps, the bits of the eager calls on copies of ``args`` (its result the next
    call's ``args[carry]`` where ``carry`` is given)."""
    runs = [args, [t.clone() for t in args]]
    torch._dynamo.reset()
    with torch._dynamo.config.patch(**config):
        compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
        for rstep in range(steps):
            for run, fn in zip(runs, (step, compiled)):
                result = fn(*run, rstep)
                if carry is not None:
                    run[carry] = result
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(*runs))
    return runs[1]


HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True, maximize=False, step=0.0)


def test_the_master_op_compiles_into_one_graph_with_the_eager_bits(lib):
    from ampkit._kernels import ops
    from ampkit._kernels.fused_adamw import Hyper

    def step(x, g, m, v, w, count, rstep):
        count += 1
        ops.master_steps_([(x, g, m, v, count, w)], Hyper(**HYPER))

    gen = torch.Generator().manual_seed(0)
    x, g = torch.randn(1000, generator=gen), torch.randn(1000, generator=gen)
    out = _compiles_as_eager(step, [x.clone(), g, torch.zeros(1000), torch.zeros(1000), x.bfloat16(), torch.zeros(())])
    assert out[5].item() == 5.0 and not torch.equal(out[0], x) and torch.equal(out[4], out[0].bfloat16())


def test_the_remainder_op_compiles_into_one_graph_with_the_eager_bits(lib):
    """The side table is the op's argument and result (a size known only when it ran: Dynamo
    captures it with ``capture_dynamic_output_shape_ops``)."""
    from ampkit._kernels import ops
    from ampkit._kernels.fused_adamw import Hyper
    from ampkit._kernels.remainder import master, remainder, side_table

    def step(w, r, g, m, v, table, count, rstep):
        count += 1
        return torch.ops.ampkit.adamw_remainder([w], [r], [g], [m], [v], [table], [count], *ops._values(Hyper(**HYPER)))[0]

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1000, generator=gen)
    bits = x.view(torch.int32)[::100]
    bits.copy_(bits & ~0x1FFFF | 0x07FFF)  # masters one ULP above what 16 bits hold: the side table lists them
    r = remainder(x)
    assert side_table(r).numel() == 10
    out = _compiles_as_eager(step, [x.bfloat16(), r.clone(), torch.randn(1000, generator=gen).bfloat16(), torch.zeros(1000),
                                    torch.zeros(1000), side_table(r).clone(), torch.zeros(())],
                             carry=5, capture_dynamic_output_shape_ops=True)
    assert out[6].item() == 5.0 and not torch.equal(master(out[0], out[1]), x)


def test_the_8bit_op_compiles_into_one_graph_with_the_eager_bits(lib):
    """O8's op (its result, how many tensors wrote, read after the graph) from element 100 of a
    tensor: a leading partial block."""
    from ampkit._kernels import ops
    from ampkit._kernels.fused_adamw import Hyper
    from ampkit._kernels.fused_adamw_8bit import backups, span

    n, first = 1000, 100
    blocks = span(n, first)

    def step(w, g, mq, ms, vq, vs, bw, bmq, bvq, bms, bvs, count, rstep):
        count += 1
        return torch.ops.ampkit.adamw_8bit([w], [g], [mq], [ms], [vq], [vs], [bw, bmq, bvq, bms, bvs], [count],
                                           *ops._values(Hyper(**HYPER)), [10.0], 7, rstep, [3], [first])

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, generator=gen).bfloat16()
    args = [w.clone(), torch.randn(n, generator=gen).bfloat16(), torch.zeros(n, dtype=torch.int8), torch.ones(blocks),
            torch.zeros(n, dtype=torch.uint8), torch.ones(blocks), *[t.clone() for t in backups([(n, blocks)], {})[0]],
            torch.zeros(())]
    out = _compiles_as_eager(step, args)
    assert out[11].item() == 5.0 and not torch.equal(out[0], w) and out[2].abs().sum() > 0


def test_a_compiled_o8_step_gives_the_eager_steps_bits():
    """A compiled O8 step (SGD with momentum: widened 8-bit state, requantized with counter bits)
    runs ampkit's step as one eager call and gives the eager step's weights and 8-bit codes (it used
    to stop with an internal Dynamo error in the counter bits' 64-bit key arithmetic)."""
    def train(compiled):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model, opt = ampkit.initialize(model, opt, opt_level="O8", verbosity=0)
        step = torch.compile(opt.step, backend="aot_eager") if compiled else opt.step
        g = torch.Generator().manual_seed(1)
        for _ in range(4):
            x, y = torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)
            with ampkit.scale_loss(nn.functional.mse_loss(model(x).float(), y), opt) as scaled:
                scaled.backward()
            step()
            opt.zero_grad()
        return model.state_dict(), [opt.state[p] for group in opt.param_groups for p in group["params"]]

    torch._dynamo.reset()
    (weights, state), (eager_weights, eager_state) = train(True), train(False)
    assert weights.keys() == eager_weights.keys() and len(state) == len(eager_state) == 4
    for key in weights:
        assert torch.equal(weights[key], eager_weights[key]), key
    assert all(any(name.endswith(".codes") for name in st) for st in state)  # the state is 8-bit
    for st, eager_st in zip(state, eager_state):
        assert st.keys() == eager_st.keys()
        for name, value in st.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(eager_st[name])), name


EAGER_CALLS = ("_zero_grad", "_open_block", "_close_block", "_drop_block", "_step")  # run eagerly, never traced


def _whole_step_run(level: str, compiled: bool, steps: int = 4):
    """Losses and final weights of ``steps`` training steps written as one function (zero_grad,
    forward, scale_loss with the backward, step), compiled whole or not; the graph breaks and
    the frames Dynamo traced when compiled."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = ampkit.initialize(model, opt, opt_level=level, verbosity=0)
    batches, _ = _batches()

    def train_step(x, y):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x).float(), y)
        with ampkit.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        return loss.detach()

    step = torch.compile(train_step, backend="aot_eager") if compiled else train_step
    losses = torch.stack([step(x["x"].bfloat16(), y) for x, y in batches[:steps]])
    weights = [p.detach().float() for p in model.parameters()]
    return losses, weights, dict(counters["graph_break"]), counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("level", ["O5", "O7"])
def test_a_wholly_compiled_training_step_traces_none_of_ampkits_bookkeeping(level):
    """The loop's calls (zero_grad, scale_loss's entry and exit, a chunked level's step) are
    skipped whole by Dynamo: its graph breaks are at those calls only (none inside them at a
    ctypes call, a file check or the backward); at O7 one graph holds the forward (O5's step is
    torch.optim's, which Dynamo compiles in graphs of its own), and the compiled step trains
    as the eager one does."""
    eager_losses, eager_weights, _, _ = _whole_step_run(level, compiled=False)
    losses, weights, breaks, graphs = _whole_step_run(level, compiled=True)
    for reason in breaks:
        assert "marked as skipped" in reason and any(f"qualname: {name}," in reason for name in EAGER_CALLS), reason
    assert graphs == 1 or level == "O5"
    torch.testing.assert_close(losses, eager_losses, rtol=TOL[level], atol=TOL[level])
    assert losses[-1] < losses[0]  # it trained
    for w, e in zip(weights, eager_weights):
        torch.testing.assert_close(w, e, rtol=TOL[level], atol=STATE_ATOL[level])
