"""``ampkit.capabilities`` and ``opt_level="auto"``, with each hardware profile and each measurement
forced: the probe's timings are injected (no test depends on what this CPU measures)."""
import dataclasses
import importlib
import json
import logging
import os
import types

import pytest
import torch
from torch import nn

import ampkit

caps_module = importlib.import_module("ampkit._hardware")

CPUS = {
    "amx": ("Intel(R) Xeon(R) Platinum", {"avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16"}, "AVX512"),
    "avx512_bf16": ("AMD EPYC 9R14", {"avx2", "avx512f", "avx512_bf16"}, "AVX512"),
    "amx_fp16": ("Intel(R) Xeon(R) 6", {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_fp16"}, "AVX512"),
    "avx2": ("AMD EPYC 7B13", {"avx2", "fma"}, "AVX2"),
    "arm_bf16": ("Neoverse-V1", {"asimd", "bf16", "sve"}, "SVE256"),
    "unknown": ("x86_64", set(), "DEFAULT"),
}


@pytest.fixture(autouse=True)
def _cache(monkeypatch, tmp_path):
    """The probe's cache in a folder of this test's own."""
    monkeypatch.setenv("AMPKIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("AMPKIT_PROBE", raising=False)


@pytest.fixture
def flags(monkeypatch):
    """No probe: the hardware description decides (the fallback)."""
    monkeypatch.setenv("AMPKIT_PROBE", "0")


def _seconds(bf16, fp16):
    """A probe's result: float32 takes 1 s per op class, the half dtypes (matmul, conv) times that."""
    return {op: {"float32": 1.0, "bfloat16": bf16[i], "float16": fp16[i]} for i, op in enumerate(("matmul", "conv"))}


@pytest.fixture
def measured(monkeypatch):
    """``measured(bf16, fp16)``: the probe finds these time ratios; returns the list of probe calls."""
    calls = []

    def force(bf16, fp16):
        def timings(device):
            calls.append(device)
            return _seconds(bf16, fp16)
        monkeypatch.setattr(caps_module, "_timings", timings)
        return calls
    return force


@pytest.fixture
def cpu(monkeypatch):
    def force(profile, isa_cap=None):
        name, flags, capability = CPUS[profile]
        monkeypatch.setattr(caps_module, "_cpu_info", lambda: (name, frozenset(flags)))
        monkeypatch.setattr(caps_module, "_cpu_capability", lambda: capability)
        monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
        if isa_cap is None:
            monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
        else:
            monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", isa_cap)
    return force


@pytest.mark.parametrize("profile, bf16, fp16, level", [
    ("amx", "AMX", "", "O5"),
    ("avx512_bf16", "AVX512-BF16", "", "O5"),
    ("amx_fp16", "AMX", "AMX-FP16", "O5"),
    ("arm_bf16", "BF16 instructions", "", "O5"),
    ("avx2", "", "", "O0"),
    ("unknown", "", "", "O0"),
])
def test_cpu_profiles(cpu, flags, profile, bf16, fp16, level):
    cpu(profile)
    caps = ampkit.capabilities("cpu")
    assert caps.source == "CPU flags (AMPKIT_PROBE=0)" and caps.measured == {} and "AMPKIT_PROBE=0" in caps.line()
    assert (caps.bf16_via, caps.fp16_via) == (bf16, fp16)
    assert caps.native_bf16 == bool(bf16) and caps.native_fp16 == bool(fp16)
    assert caps.name == CPUS[profile][0] and caps.isa.startswith(CPUS[profile][2])
    assert caps.levels["O0"] == caps_module.NONE
    assert caps.levels["O5"] == caps.levels["O4"] == (caps_module.SPEED if bf16 else caps_module.SLOWER)
    assert caps.levels["O2"] == (caps_module.SPEED if fp16 else caps_module.SLOWER)
    assert list(caps.levels) == list(ampkit.OPT_LEVELS)  # every row of the table, new levels included
    assert caps.levels["O7"] == caps.levels["O5"] and caps.levels["O6"] == caps_module.FP8_EMULATED
    assert ("bfloat16 native" in caps.line()) == bool(bf16) and CPUS[profile][0] in caps.line()
    assert caps_module.auto_level("cpu")[0] == level


def test_onednn_isa_cap_turns_native_bf16_off(cpu, flags):
    cpu("amx", isa_cap="avx2")
    caps = ampkit.capabilities()
    assert not caps.native_bf16 and "ONEDNN_MAX_CPU_ISA=AVX2" in caps.line()
    assert caps_module.auto_level("cpu")[0] == "O0"
    cpu("amx", isa_cap="AVX512_CORE_AMX")
    assert ampkit.capabilities("cpu").bf16_via == "AMX"


@pytest.mark.parametrize("cc, level, bf16, fp16", [
    ((9, 0), "O5", True, True), ((8, 9), "O5", True, True), ((8, 0), "O5", True, True), ((7, 5), "O2", False, True),
    ((6, 1), "O0", False, False),
])
def test_cuda_profiles(monkeypatch, flags, cc, level, bf16, fp16):
    monkeypatch.setattr(caps_module, "_cuda_info", lambda index: (f"GPU{index}", cc))
    caps = ampkit.capabilities("cuda:1")
    assert caps.device == "cuda:1" and caps.isa == f"sm_{cc[0]}{cc[1]}" and caps.name == "GPU1"
    assert (caps.native_bf16, caps.native_fp16) == (bf16, fp16)
    assert caps.levels["O5"] == (caps_module.SPEED if bf16 else caps_module.MEMORY)
    assert caps.levels["O1"] == (caps_module.SPEED if fp16 else caps_module.MEMORY)
    assert caps.levels["O7"] == caps.levels["O5"]
    assert caps.levels["O6"] == (caps_module.SPEED if cc >= (8, 9) else caps_module.FP8_EMULATED)
    chosen, why = caps_module.auto_level(torch.device("cuda:1"))
    assert chosen == level and f"chose {level}" in why and "sm_" in why


def test_other_devices_stay_at_o0(measured):
    calls = measured((0.5, 0.5), (0.5, 0.5))
    caps = ampkit.capabilities("meta")
    assert not caps.native_bf16 and caps_module.auto_level("meta")[0] == "O0"
    assert caps.source == "not measured on meta" and calls == []


# --- the probe decides where it runs -------------------------------------------------------

SLOWER, MEMORY, SPEED = caps_module.SLOWER, caps_module.MEMORY, caps_module.SPEED


@pytest.mark.parametrize("bf16, fp16, level, bf16_gain, fp16_gain", [
    ((1.9, 0.88), (1.02, 0.97), "O0", SLOWER, MEMORY),  # the Xeon VM of issue 39: AVX512-BF16, bf16 matmuls slow
    ((0.6, 0.65), (35.0, 3.6), "O5", SPEED, SLOWER),  # an EPYC with AVX512-BF16: bf16 fast, fp16 emulated
    ((1.26, 0.88), (0.65, 0.8), "O2", SLOWER, SPEED),  # float16 the fast one
    ((0.3, 0.5), (0.3, 0.5), "O5", SPEED, SPEED),  # both fast: bfloat16 needs no loss scaling
    ((0.5, 0.95), (0.5, 1.5), "O0", MEMORY, SLOWER),  # faster matmuls, but not on every op class
])
def test_auto_follows_the_measurement_not_the_flags(cpu, measured, bf16, fp16, level, bf16_gain, fp16_gain):
    for profile in ("avx512_bf16", "avx2"):  # the flags say opposite things; the measurement decides
        cpu(profile)
        measured(bf16, fp16)
        caps = ampkit.capabilities("cpu")
        assert caps.source == f"measured at {torch.get_num_threads()} thread" + ("s" * (torch.get_num_threads() > 1))
        assert caps.measured == {"bfloat16": dict(zip(("matmul", "conv"), bf16)), "float16": dict(zip(("matmul", "conv"), fp16))}
        assert (caps.levels["O4"], caps.levels["O5"], caps.levels["O7"], caps.levels["O8"]) == (bf16_gain,) * 4
        assert (caps.levels["O1"], caps.levels["O2"], caps.levels["O3"]) == (fp16_gain,) * 3
        assert caps.levels["O0"] == caps_module.NONE and caps.levels["O6"] == caps_module.FP8_EMULATED
        assert f"bfloat16 matmul {bf16[0]:.2f}x, conv {bf16[1]:.2f}x float32's time" in caps.line()
        chosen, why = caps_module.auto_level("cpu")
        assert chosen == level and f"chose {level}" in why and "measured at" in why
        if level == "O0":
            assert "no half dtype is faster than float32" in why and f"O5 here: {bf16_gain}" in why


def test_auto_on_the_xeon_of_issue_39_initializes_fp32_and_says_why(cpu, measured, caplog):
    cpu("amx")
    measured((1.9, 0.88), (1.02, 0.97))
    with caplog.at_level(logging.INFO, logger="ampkit"):
        model = ampkit.initialize(_model(), opt_level="auto", verbosity=1)
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert "chose O0" in text and "bfloat16 matmul 1.90x" in text and "memory only, slower than O0" in text


def test_the_measurement_is_cached_per_machine_torch_and_threads(cpu, measured, monkeypatch, tmp_path):
    cpu("avx512_bf16")
    calls = measured((0.5, 0.5), (2.0, 2.0))
    first = ampkit.capabilities("cpu")
    assert ampkit.capabilities("cpu") == first and len(calls) == 1  # the second call reads the cache
    [path] = (tmp_path / "cache" / "probe").iterdir()
    entry = json.loads(path.read_text())
    assert entry["seconds"] == _seconds((0.5, 0.5), (2.0, 2.0))
    assert entry["key"]["cpu"] == CPUS["avx512_bf16"][0] and entry["key"]["torch"] == torch.__version__
    assert entry["key"]["threads"] == torch.get_num_threads()
    monkeypatch.setattr(torch, "get_num_threads", lambda: 7)
    ampkit.capabilities("cpu")
    cpu("amx")
    ampkit.capabilities("cpu")
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    ampkit.capabilities("cpu")
    assert len(calls) == 4 and len(list((tmp_path / "cache" / "probe").iterdir())) == 4  # no leftover temporary files


@pytest.mark.parametrize("damage", ["", "{not json", "[]", '{"key": 1}', "null",
                                    '{"key": null, "seconds": {"matmul": {"float32": 1}}}'])
def test_a_damaged_cache_is_measured_again_and_rewritten(cpu, measured, tmp_path, damage):
    cpu("avx512_bf16")
    calls = measured((0.5, 0.5), (2.0, 2.0))
    expected = ampkit.capabilities("cpu")
    [path] = (tmp_path / "cache" / "probe").iterdir()
    path.write_text(damage)
    assert ampkit.capabilities("cpu") == expected and len(calls) == 2
    assert json.loads(path.read_text())["seconds"] == _seconds((0.5, 0.5), (2.0, 2.0))


def test_a_cache_of_another_key_under_the_same_name_is_not_used(cpu, measured, tmp_path):
    cpu("avx512_bf16")
    calls = measured((0.5, 0.5), (2.0, 2.0))
    ampkit.capabilities("cpu")
    [path] = (tmp_path / "cache" / "probe").iterdir()
    entry = json.loads(path.read_text())
    path.write_text(json.dumps({**entry, "key": {**entry["key"], "threads": 99}}))
    ampkit.capabilities("cpu")
    assert len(calls) == 2 and json.loads(path.read_text())["key"] == entry["key"]


def test_an_unwritable_cache_still_gives_the_measurement(cpu, measured, monkeypatch, tmp_path):
    cpu("avx512_bf16")
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("AMPKIT_CACHE_DIR", str(tmp_path / "file"))  # a file where the folder would be
    calls = measured((2.0, 2.0), (2.0, 2.0))
    assert ampkit.capabilities("cpu").source.startswith("measured") and caps_module.auto_level("cpu")[0] == "O0"
    assert len(calls) == 2  # nothing cached: each call measures


def test_the_fallback_says_which_it_is(cpu, measured, monkeypatch, caplog):
    cpu("avx512_bf16")
    calls = measured((2.0, 2.0), (2.0, 2.0))
    monkeypatch.setenv("AMPKIT_PROBE", "0")
    caps = ampkit.capabilities("cpu")
    assert calls == [] and caps.source == "CPU flags (AMPKIT_PROBE=0)" and caps.levels["O5"] == SPEED
    monkeypatch.delenv("AMPKIT_PROBE")

    def broken(device):
        raise RuntimeError("no bfloat16 convolution in this build")
    monkeypatch.setattr(caps_module, "_timings", broken)
    with caplog.at_level(logging.INFO, logger="ampkit"):
        caps = ampkit.capabilities("cpu")
    assert caps.source == "CPU flags (the speed probe failed: RuntimeError)" and caps.measured == {}
    assert "the speed probe failed" in caplog.text and "no bfloat16 convolution" in caplog.text
    assert caps_module.auto_level("cpu")[0] == "O5" and "[CPU flags (the speed probe failed" in caps.line()
    assert not os.path.exists(os.path.join(os.environ["AMPKIT_CACHE_DIR"], "probe")) or not os.listdir(
        os.path.join(os.environ["AMPKIT_CACHE_DIR"], "probe"))


def test_the_probe_times_every_op_class_in_every_dtype():
    seconds = caps_module._timings(torch.device("cpu"))  # the real probe: its shape, not its numbers
    assert set(seconds) == {"matmul", "conv"}
    assert all(set(row) == {"float32", "bfloat16", "float16"} and all(t > 0 for t in row.values()) for row in seconds.values())


def test_the_probe_alternates_the_dtypes_and_lets_an_emulated_one_leave_early(monkeypatch):
    """A fake clock: each call advances it by its dtype's cost (float16 emulated: 40x). Every dtype gets a
    warm-up and 2 timed rounds; float16 then leaves (all its samples over 3x float32's), the others take
    all 5; the fastest rounds are the costs."""
    clock, calls = [0.0], []
    cost = {"float32": 1.0, "bfloat16": 0.5, "float16": 40.0}

    def workloads(device, dtype):
        name = str(dtype).removeprefix("torch.")

        def call(op):
            calls.append((op, name))
            clock[0] += cost[name] * (2 if op == "conv" else 1)
        return {op: (lambda op=op: call(op)) for op in ("matmul", "conv")}
    monkeypatch.setattr(caps_module, "_workloads", workloads)
    monkeypatch.setattr(caps_module, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    seconds = caps_module._timings(torch.device("cpu"))
    assert seconds == {"matmul": cost, "conv": {k: 2 * v for k, v in cost.items()}}
    assert [calls.count(("matmul", n)) for n in ("float32", "bfloat16", "float16")] == [6, 6, 3]
    assert calls[:6] == [(op, n) for n in ("float32", "bfloat16", "float16") for op in ("matmul", "conv")]  # alternating


def test_the_probe_runs_under_no_grad_inference_mode_and_autocast():
    with torch.no_grad(), torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        seconds = caps_module._timings(torch.device("cpu"))
    assert set(seconds) == {"matmul", "conv"}


def test_every_rank_takes_rank_0s_answer(cpu, measured, monkeypatch):
    """Ranks that measure a little differently must still pick one level: auto broadcasts rank 0's capabilities."""
    cpu("avx2")
    measured((2.0, 2.0), (2.0, 2.0))
    rank0 = dataclasses.replace(ampkit.capabilities("cpu"), levels=caps_module._levels(SPEED, SLOWER), name="rank 0")
    dist = torch.distributed
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    sent = []

    def broadcast(box, src):
        sent.append((box[0].name, src))
        box[0] = rank0
    monkeypatch.setattr(dist, "broadcast_object_list", broadcast)
    chosen, why = caps_module.auto_level("cpu")
    assert chosen == "O5" and "rank 0" in why and sent == [(CPUS["avx2"][0], 0)]


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))


@pytest.mark.parametrize("profile, level", [("avx512_bf16", "O5"), ("avx2", "O0")])
def test_initialize_auto_picks_and_says_why(cpu, flags, caplog, profile, level):
    cpu(profile)
    model, opt = _model(), None
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.INFO, logger="ampkit"):
        model, opt = ampkit.initialize(model, opt, opt_level="auto", verbosity=1)
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert f"ampkit {level}: " in text and f"opt_level='auto' chose {level}" in text
    assert CPUS[profile][0] in text
    reference = _model()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    reference, ref_opt = ampkit.initialize(reference, ref_opt, opt_level=level, verbosity=0)
    assert [p.dtype for p in model.parameters()] == [p.dtype for p in reference.parameters()]
    assert bool(opt._ampkit.masters) == (level == "O5")
    x = torch.randn(16, 4)
    torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)


def test_initialize_auto_is_silent_at_verbosity_0_and_takes_overrides(cpu, flags, caplog):
    cpu("amx")
    with caplog.at_level(logging.INFO, logger="ampkit"):
        model = ampkit.initialize(_model(), opt_level="auto", verbosity=0, half_dtype=torch.float16)
    assert not caplog.records
    assert model[0].weight.dtype == torch.float16 and model[1].weight.dtype == torch.float32  # O5 with fp16


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_real_cuda_device():
    caps = ampkit.capabilities("cuda:0")
    major, minor = torch.cuda.get_device_capability(0)
    assert caps.isa == f"sm_{major}{minor}" and caps.native_bf16 == (major >= 8)
    model = ampkit.initialize(_model().cuda(), opt_level="auto", verbosity=0)
    expected = caps_module.auto_level("cuda:0")[0]
    assert model[0].weight.dtype == {"O5": torch.bfloat16, "O2": torch.float16, "O0": torch.float32}[expected]


def test_the_probe_keeps_the_fastest_round_through_load_that_comes_and_goes(monkeypatch):
    """Load on the machine only adds time: float32 disturbed in 3 of its 5 rounds still measures its cost."""
    clock, rounds = [0.0], {}
    cost = {"float32": 1.0, "bfloat16": 0.5, "float16": 0.75}  # exact in binary: the fake clock adds them up

    def workloads(device, dtype):
        name = str(dtype).removeprefix("torch.")

        def call(op):
            n = rounds[op, name] = rounds.get((op, name), -1) + 1
            clock[0] += cost[name] * (10 if name == "float32" and n in (1, 2, 4) else 1)
        return {op: (lambda op=op: call(op)) for op in ("matmul", "conv")}
    monkeypatch.setattr(caps_module, "_workloads", workloads)
    monkeypatch.setattr(caps_module, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    assert caps_module._timings(torch.device("cpu")) == {"matmul": cost, "conv": cost}


def test_a_disturbed_probe_is_measured_again_and_never_cached(cpu, measured, monkeypatch, tmp_path, caplog):
    # A bfloat16 matmul at 0.01x float32's time is no device's: float32's samples were slowed by other work.
    cpu("avx512_bf16")
    calls = measured((0.01, 0.5), (2.0, 2.0))
    with caplog.at_level(logging.INFO, logger="ampkit"):
        caps = ampkit.capabilities("cpu")
    assert len(calls) == 2 and caps.measured == {} and caps.source == "CPU flags (the speed probe was disturbed)"
    assert "disturbed twice" in caplog.text and not (tmp_path / "cache" / "probe").exists()
    answers = iter([_seconds((0.01, 0.5), (2.0, 2.0)), _seconds((0.5, 0.5), (2.0, 2.0))])
    monkeypatch.setattr(caps_module, "_timings", lambda device: next(answers))
    caps = ampkit.capabilities("cpu")  # the second measurement is plausible: kept and cached
    assert caps.measured["bfloat16"]["matmul"] == 0.5 and caps.source.startswith("measured")
    [path] = (tmp_path / "cache" / "probe").iterdir()
    assert json.loads(path.read_text())["seconds"] == _seconds((0.5, 0.5), (2.0, 2.0))
    path.write_text(json.dumps({**json.loads(path.read_text()), "seconds": _seconds((0.01, 0.5), (2.0, 2.0))}))
    calls, before = measured((0.5, 0.5), (2.0, 2.0)), len(calls)
    ampkit.capabilities("cpu")  # an implausible cached entry (an older ampkit's) is measured again
    assert len(calls) == before + 1
