"""``ampkit.capabilities`` and ``opt_level="auto"``, with each hardware profile forced."""
import importlib
import logging

import pytest
import torch
from torch import nn

import ampkit

caps_module = importlib.import_module("ampkit.install.hardware")

CPUS = {
    "amx": ("Intel(R) Xeon(R) Platinum", {"avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16"}, "AVX512"),
    "avx512_bf16": ("AMD EPYC 9R14", {"avx2", "avx512f", "avx512_bf16"}, "AVX512"),
    "amx_fp16": ("Intel(R) Xeon(R) 6", {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_fp16"}, "AVX512"),
    "avx2": ("AMD EPYC 7B13", {"avx2", "fma"}, "AVX2"),
    "arm_bf16": ("Neoverse-V1", {"asimd", "bf16", "sve"}, "SVE256"),
    "unknown": ("x86_64", set(), "DEFAULT"),
}


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
def test_cpu_profiles(cpu, profile, bf16, fp16, level):
    cpu(profile)
    caps = ampkit.capabilities("cpu")
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


def test_onednn_isa_cap_turns_native_bf16_off(cpu):
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
def test_cuda_profiles(monkeypatch, cc, level, bf16, fp16):
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


def test_other_devices_stay_at_o0():
    caps = ampkit.capabilities("meta")
    assert not caps.native_bf16 and caps_module.auto_level("meta")[0] == "O0"


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))


@pytest.mark.parametrize("profile, level", [("avx512_bf16", "O5"), ("avx2", "O0")])
def test_initialize_auto_picks_and_says_why(cpu, caplog, profile, level):
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


def test_initialize_auto_is_silent_at_verbosity_0_and_takes_overrides(cpu, caplog):
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
