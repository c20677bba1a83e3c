"""The demo's sizing to the machine (probe -> plan) and what it says about half precision."""
import importlib
import json
import math

import pytest
import torch

import ampkit
from ampkit._cli import demo

caps_module = importlib.import_module("ampkit._hardware")


def _times(first, step, levels=("O0", "O2", "O5", "O6")):
    return {f"{m} {lvl}": [first, step] for m in demo.MODELS for lvl in levels}


def _spent(times, steps, scale):
    """Seconds of training the plan expects for every model at every level."""
    k = scale / demo.PROBE_SCALE
    runs = [times[f"{m} {demo._probe_level(lvl)}"] for m in demo.MODELS for lvl in demo.LEVELS]
    return sum(demo.RUN_OVERHEAD_S + first * max(k, 1.0) + (steps - 1) * step * k for first, step in runs)


def test_plan_uses_full_size_on_a_fast_machine():
    assert demo.plan(_times(0.01, 0.001), demo.MODELS, demo.LEVELS) == (demo.MAX_STEPS, 1.0)


def test_plan_shrinks_steps_then_batch_to_fit_the_budget():
    steps, scale = demo.plan(_times(0.2, 0.02), demo.MODELS, demo.LEVELS)
    assert demo.MIN_STEPS <= steps <= demo.MAX_STEPS and _spent(_times(0.2, 0.02), steps, scale) <= demo.BUDGET_S
    assert scale < 1.0 or steps < demo.MAX_STEPS
    # a machine ten times slower gets a smaller batch, never fewer than MIN_STEPS while one fits
    slow_steps, slow_scale = demo.plan(_times(0.2, 0.2), demo.MODELS, demo.LEVELS)
    assert slow_scale < scale and slow_steps >= demo.MIN_STEPS


def test_plan_on_a_hopeless_machine_runs_a_few_steps_at_the_smallest_batch():
    assert demo.plan(_times(5.0, 5.0), demo.MODELS, demo.LEVELS) == (3, demo.SCALES[-1])


def test_each_level_is_probed_by_its_compute_dtype():
    assert {lvl: demo._probe_level(lvl) for lvl in demo.LEVELS} == {
        "O0": "O0", "O1": "O2", "O2": "O2", "O3": "O2", "O4": "O5", "O5": "O5", "O6": "O6", "O7": "O5", "O8": "O5"}


def test_a_slow_fp8_probe_gives_fewer_steps():
    times = _times(0.2, 0.02)
    steps, scale = demo.plan(times, demo.MODELS, demo.LEVELS)
    times.update({f"{m} O6": [1.0, 0.1] for m in demo.MODELS})  # fp8 emulated: 5x bf16
    slow_steps, slow_scale = demo.plan(times, demo.MODELS, demo.LEVELS)
    assert slow_steps * slow_scale < steps * scale and _spent(times, slow_steps, slow_scale) <= demo.BUDGET_S


def test_a_slow_start_and_probe_leave_less_time_for_training():
    assert demo.run_budget(5.0) == demo.BUDGET_S
    assert demo.run_budget(demo.DEADLINE_S - 12.0) == 12.0
    times = _times(0.2, 0.02)
    steps, scale = demo.plan(times, demo.MODELS, demo.LEVELS, demo.run_budget(5.0))
    late_steps, late_scale = demo.plan(times, demo.MODELS, demo.LEVELS, demo.run_budget(demo.DEADLINE_S - 12.0))
    assert late_steps * late_scale < steps * scale and _spent(times, late_steps, late_scale) <= 12.0


def _caps(monkeypatch, flags, seconds=None):
    """This CPU's capabilities with ``flags``; measured as ``seconds`` (op -> dtype -> s), else from the flags."""
    monkeypatch.setattr(caps_module, "_cpu_info", lambda: ("Test CPU", frozenset(flags)))
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    monkeypatch.setenv("AMPKIT_PROBE", "1" if seconds else "0")
    monkeypatch.setattr(caps_module, "_timings", lambda device: seconds)
    monkeypatch.setattr(caps_module, "_cached", lambda path, key: None)
    monkeypatch.setattr(caps_module, "_store", lambda path, entry: None)
    return ampkit.capabilities("cpu")


def _seconds(bf16, fp16):
    return {op: {"float32": 1.0, "bfloat16": bf16, "float16": fp16} for op in ("matmul", "conv")}


def test_describe_says_plainly_when_half_only_saves_memory(monkeypatch):
    text = "\n".join(demo.describe(_caps(monkeypatch, {"avx2"})))
    assert "Test CPU" in text and "only saves memory" in text and "slower than O0" in text
    text = "\n".join(demo.describe(_caps(monkeypatch, {"avx512_bf16"})))
    assert "O4/O5/O7/O8: speed and memory" in text and "O1/O2/O3 only save memory" in text
    text = "\n".join(demo.describe(_caps(monkeypatch, {"amx_bf16", "amx_fp16"})))
    assert "only save" not in text and "O1/O2/O3/O4/O5/O7/O8: speed and memory" in text


def test_describe_follows_the_measurement_not_the_flags(monkeypatch):
    text = "\n".join(demo.describe(_caps(monkeypatch, {"avx512_bf16"}, _seconds(1.9, 1.0))))  # issue 39's Xeon
    assert "No half dtype is faster than float32 here" in text and "bfloat16 matmul 1.90x" in text
    assert "O4/O5/O7/O8: memory only, slower than O0" in text and "speed and memory" not in text
    text = "\n".join(demo.describe(_caps(monkeypatch, {"avx2"}, _seconds(1.5, 0.5))))
    assert "bfloat16 is not faster than float32 here" in text and "O1/O2/O3: speed and memory" in text


def test_the_demo_recommends_o0_where_half_is_measured_slower(monkeypatch):
    """On a CPU whose bf16 matmuls are slower than fp32 the advice is O0, and the memory pick says it is slower."""
    _caps(monkeypatch, {"avx512_bf16", "amx_bf16"}, _seconds(1.9, 1.2))
    found = demo.advice("cpu")  # the demo LM's real precision report, judged for this measured CPU
    assert found["level"] == "O0" and "No half dtype is faster than float32" in found["reason"]
    memory = found["memory_level"]
    assert memory != "O0" and found["memory_slower"] and f"{memory} runs slower than O0 here" in found["memory_reason"]
    lines = demo.recommendation([_row("O0", 1.0, 0.1, bpp=8.0), _row(memory, 0.5, 0.1, bpp=4.0)], found)
    assert lines[0].startswith("Recommended here: O0.") and lines[-1] == (
        f"  {memory} runs slower than O0 on this machine: pick it for the memory, not for speed.")


def test_default_demo_probes_then_runs(tmp_path, capsys):
    path = tmp_path / "demo.json"
    rows = demo.main(levels=("O0", "O5"), models=("cnn",), device="cpu", json_path=str(path))
    out = capsys.readouterr().out
    assert out.index("This machine:") < out.index("Speed probe") < out.index("held-out loss") < out.index("Recommended here: O")
    data = json.loads(path.read_text())
    assert set(data["probe"]) == {"cnn O0", "cnn O5"} and all(f > 0 and s > 0 for f, s in data["probe"].values())
    assert 3 <= data["steps"] <= demo.MAX_STEPS and data["batch_scale"] in demo.SCALES
    assert data["capabilities"]["device"] == "cpu"
    assert [r["batch"] for r in rows] == [demo._size("cnn", data["batch_scale"])] * 2
    assert rows[0]["first_loss"] == pytest.approx(rows[1]["first_loss"], rel=0.02)


def test_lm_shape_shrinks_sequences_after_the_batch():
    assert (demo._lm_shape(1.0).batch, demo._lm_shape(1.0).seq_len) == (16, 64)
    assert (demo._lm_shape(1 / 8).batch, demo._lm_shape(1 / 8).seq_len) == (2, 64)
    assert (demo._lm_shape(1 / 32).batch, demo._lm_shape(1 / 32).seq_len) == (2, 16)
    assert demo._size("lm", 1 / 16) == "2x32 tokens" and demo._size("cnn", 1 / 16) == "2 images"


def test_step_spread_is_relative_and_needs_two_steps():
    assert demo.step_spread([1.0]) == float("inf")
    assert demo.step_spread([1.0, 1.0, 1.0]) == 0.0
    assert demo.step_spread([1.0, 2.0]) == pytest.approx(1 / 1.5)  # range over median below 4 steps
    assert demo.step_spread([1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 9.0]) == 0.0  # one outlier outside the quartiles


def _row(level, speedup, spread, model="lm", before=5.5, after=4.0, bpp=10.0):
    return {"model": model, "level": level, "speedup": speedup, "step_spread": spread, "noise": False,
            "heldout_first": before, "heldout_final": after, "steps": 10, "bytes_per_param": bpp}


def test_a_ratio_inside_the_spread_is_noise():
    base = _row("O0", 1.0, 0.05)
    assert demo.within_noise(_row("O5", 1.04, 0.02), base)
    assert not demo.within_noise(_row("O5", 1.5, 0.02), base)
    assert demo.within_noise(_row("O5", 1.5, 0.5), base)


def test_the_note_explains_the_memory_levels_where_the_numbers_are():
    o8, o7 = demo.note("O8", torch.device("cpu")), demo.note("O7", torch.device("cpu"))
    assert "8-bit" in o8 and "peak" in o8 and "no masters" in o7 and "peak" in o7
    assert demo.note("O5", torch.device("cpu")) == "half model + fp32 master weights"
    assert demo.note("O0", torch.device("cpu")) == "the fp32 reference"
    assert {demo.note(lvl, torch.device("cpu")) for lvl in demo.LEVELS} >= {"pure half: no masters, no loss scaling"}


def test_the_fp8_hint_names_the_editable_install_from_a_checkout():
    assert demo.install_hint("ampkit[fp8]") == 'from this checkout: pip install -e ".[fp8]"'  # the tests run from one


def test_caveats_say_plainly_when_speed_is_noise_or_nothing_was_learned():
    rows = [_row("O0", 1.0, 0.3), dict(_row("O5", 1.1, 0.3), noise=True), _row("O0", 1.0, 0.1, "cnn", 2.0, 2.1)]
    busy = "\n".join(demo.caveats(rows, {"load_average": 5.0, "cores": 2}, torch.device("cpu")))
    assert "~: the ratio is inside" in busy and "noise-level" in busy and "held-out loss of cnn did not fall" in busy
    quiet = demo.caveats(rows[:1], {"load_average": 0.5, "cores": 2}, torch.device("cpu"))
    assert quiet == []


def test_the_demo_ends_with_one_recommendation_and_what_this_run_measured():
    rows = [_row("O0", 1.0, 0.1, bpp=8.0), _row("O5", 1.4, 0.1), _row("O8", 0.6, 0.1, bpp=3.0)]
    found = {"level": "O5", "reason": "Bfloat16 runs natively on test.", "memory_level": "O7", "memory_reason": "..."}
    lines = demo.recommendation(rows, found)
    assert lines[0] == "Recommended here: O5. Bfloat16 runs natively on test."
    assert "1.40x O0's steps/s (faster than O0)" in lines[1] and "O8 keeps 3.0 bytes/param" in lines[2]


def test_a_run_scores_its_held_out_batch_and_times_each_step():
    row = demo.train("lm", "O0", 4, "cpu", 1 / 32)
    assert math.isfinite(row["heldout_first"]) and math.isfinite(row["heldout_final"])
    assert row["heldout_first"] != row["heldout_final"] and row["steps_per_s"] > 0 and row["step_spread"] >= 0
    train, heldout = demo._batches("lm", 1 / 32)
    assert len(train) == 8 and not any(torch.equal(heldout[0], x) for x, _ in train)
