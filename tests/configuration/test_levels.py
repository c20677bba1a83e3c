import dataclasses
import math

import pytest
import torch

from ampkit._config.levels import (
    HALF_DTYPE, OPT_LEVELS, OVERRIDES, UpdateKind, check_opt_level, format_table, markdown_table, resolve,
)

TABLE = {
    # level: cast_model_type, patch, keep_bn, master, loss_scale, half_dtype
    "O0": (torch.float32, False, None, False, 1.0, None),
    "O1": (None, True, None, None, "dynamic", torch.float16),
    "O2": (HALF_DTYPE, False, True, True, "dynamic", torch.float16),
    "O3": (HALF_DTYPE, False, False, False, 1.0, torch.float16),
    "O4": (None, True, None, None, 1.0, torch.bfloat16),
    "O5": (HALF_DTYPE, False, True, True, 1.0, torch.bfloat16),
}


@pytest.mark.parametrize("level", list(TABLE))
def test_table_matches_the_issue(level):
    p = OPT_LEVELS[level]
    got = (p.cast_model_type, p.patch_torch_functions, p.keep_batchnorm_fp32, p.master_weights, p.loss_scale, p.half_dtype)
    assert got == TABLE[level]
    assert p.low_precision_layernorm is False


@pytest.mark.parametrize("level,cast", [("O2", torch.float16), ("O3", torch.float16), ("O5", torch.bfloat16), ("O1", None), ("O0", torch.float32)])
def test_cast_model_type_follows_half_dtype(level, cast):
    _, final, applied, notes = resolve(level)
    assert final.cast_model_type == cast and applied == {} and notes == []


def test_half_dtype_override_moves_the_cast():
    _, final, applied, _ = resolve("O2", half_dtype=torch.bfloat16)
    assert final.cast_model_type == torch.bfloat16 and applied == {"half_dtype": torch.bfloat16}


@pytest.mark.parametrize("value,expected", [(True, True), (False, False), ("True", True), ("False", False)])
def test_keep_batchnorm_fp32_accepts_apex_forms(value, expected):
    assert resolve("O2", keep_batchnorm_fp32=value)[1].keep_batchnorm_fp32 is expected


@pytest.mark.parametrize("value,expected", [(128, 128.0), ("128.0", 128.0), (0.5, 0.5), ("dynamic", "dynamic")])
def test_loss_scale_accepts_numbers_strings_dynamic(value, expected):
    assert resolve("O3", loss_scale=value)[1].loss_scale == expected


@pytest.mark.parametrize("level", ["O0", "O1", "O4"])
def test_keep_batchnorm_fp32_without_cast_is_a_note_not_an_error(level):
    _, final, _, notes = resolve(level, keep_batchnorm_fp32=True)
    assert final.keep_batchnorm_fp32 is True
    assert len(notes) == 1 and "keep_batchnorm_fp32=True has no effect at " + level in notes[0]


@pytest.mark.parametrize("bad", ["00", "01", "02", "03", "o1"])
def test_digit_zero_gets_a_hint(bad):
    with pytest.raises(ValueError, match=r"did you mean 'O%s' \(letter O\)" % bad[1]):
        check_opt_level(bad)


@pytest.mark.parametrize("bad", ["O9", "fast", 1, None])
def test_unknown_level_lists_accepted(bad):
    with pytest.raises(ValueError, match=r"ccepted values are 'O0', 'O1', 'O2', 'O3', 'O4', 'O5'"):
        check_opt_level(bad)


@pytest.mark.parametrize(
    "name,value,exc",
    [
        ("keep_batchnorm_fp32", "maybe", TypeError),
        ("keep_batchnorm_fp32", 1, TypeError),
        ("master_weights", "yes", TypeError),
        ("patch_torch_functions", 0, TypeError),
        ("loss_scale", -1, ValueError),
        ("loss_scale", 0, ValueError),
        ("loss_scale", math.nan, ValueError),
        ("loss_scale", math.inf, ValueError),
        ("loss_scale", "fast", ValueError),
        ("loss_scale", True, ValueError),
        ("cast_model_type", torch.int32, TypeError),
        ("cast_model_type", "float16", TypeError),
        ("half_dtype", torch.float32, TypeError),
        ("half_dtype", torch.int8, TypeError),
    ],
)
def test_bad_override_names_argument(name, value, exc):
    with pytest.raises(exc, match=rf"initialize\({name}="):
        resolve("O2", **{name: value})


def test_format_table_lists_every_level():
    text = format_table()
    for level in OPT_LEVELS:
        assert f"\n{level} " in text or text.startswith(level)
    assert "bfloat16" in text and "dynamic" in text


# --- the memory levels: O6 (fp8) and O7 (bf16 without masters, rounded updates) ---------

def test_o6_is_o5_plus_fp8_and_o7_is_bf16_without_masters():
    o5, o6, o7 = OPT_LEVELS["O5"], OPT_LEVELS["O6"], OPT_LEVELS["O7"]
    assert o6.rows()[1:] == [(k, True if k == "fp8" else v) for k, v in o5.rows()[1:]]
    assert (o7.cast_model_type, o7.master_weights, o7.half_dtype, o7.loss_scale, o7.keep_batchnorm_fp32) == (HALF_DTYPE, False, torch.bfloat16, 1.0, True)
    assert (o7.update_rounding, o7.optimizer_state_dtype, o7.fp8) == ("stochastic", None, False)
    for level in ("O0", "O1", "O2", "O3", "O4", "O5"):
        assert (OPT_LEVELS[level].update_rounding, OPT_LEVELS[level].optimizer_state_dtype, OPT_LEVELS[level].fp8) == (None, None, False)


@pytest.mark.parametrize("name,value,exc", [
    ("update_rounding", "kahan", ValueError), ("update_rounding", True, ValueError),
    ("optimizer_state_dtype", torch.float16, TypeError), ("optimizer_state_dtype", "bfloat16", TypeError),
    ("fp8", "yes", ValueError), ("fp8", 1, ValueError),
])
def test_bad_memory_overrides_name_the_argument(name, value, exc):
    with pytest.raises(exc, match=rf"initialize\({name}="):
        resolve("O7", **{name: value})


def test_stochastic_rounding_needs_bfloat16():
    with pytest.raises(ValueError, match=r"update_rounding='stochastic'.*half_dtype=torch.bfloat16"):
        resolve("O7", half_dtype=torch.float16)
    assert resolve("O3", update_rounding="nearest")[1].update_rounding == "nearest"  # fp16 to nearest is fine


@pytest.mark.parametrize("level,overrides,note", [
    ("O5", dict(update_rounding="stochastic"), "update lands in the float32 masters"),
    ("O0", dict(update_rounding="nearest"), "not cast to a half dtype"),
    ("O5", dict(optimizer_state_dtype=torch.bfloat16), "optimizer_state_dtype=torch.bfloat16 has no effect at O5"),
])
def test_memory_overrides_without_effect_are_notes(level, overrides, note):
    _, final, _, notes = resolve(level, **overrides)
    assert final.update_rounding is None and final.optimizer_state_dtype is None
    assert len(notes) == 1 and note in notes[0]


def test_o7_with_masters_or_without_rounding_falls_back_quietly():
    _, final, _, notes = resolve("O7", master_weights=True)
    assert final.update_rounding is None and notes == []
    _, final, _, notes = resolve("O7", update_rounding=False, optimizer_state_dtype=torch.bfloat16)
    assert final.update_rounding is None and final.optimizer_state_dtype is None and len(notes) == 1


@pytest.mark.repo_files("README.md")
def test_readme_table_is_the_generated_one():
    """README.md carries markdown_table() (the docs generate it at build time; the README cannot)."""
    from pathlib import Path

    text = (Path(__file__).parents[2] / "README.md").read_text()
    assert markdown_table() in text, "README.md's level table is stale: paste ampkit._config.levels.markdown_table()"


def test_markdown_table_shows_every_level_and_property():
    lines = markdown_table().split("\n\n")[0].splitlines()
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = {cells[0]: dict(zip(head, cells)) for cells in ([c.strip() for c in ln.strip("|").split("|")] for ln in lines[2:])}
    assert list(rows) == list(OPT_LEVELS) and head[1:] == list(OVERRIDES)

    def show(v):
        if isinstance(v, torch.dtype):
            return str(v).replace("torch.", "")
        return str(v)
    for level, p in OPT_LEVELS.items():
        for name in head[1:]:
            assert rows[level][name] == show(getattr(p, name)), (level, name)
    assert format_table().splitlines()[0].split() == head  # `ampkit levels` has the same columns


def test_o8_is_o7_with_8bit_state():
    o7, o8 = OPT_LEVELS["O7"], OPT_LEVELS["O8"]
    assert o8.rows()[1:] == [(k, "8bit" if k == "optimizer_state_dtype" else v) for k, v in o7.rows()[1:]]
    _, final, applied, notes = resolve("O8")
    assert (final.cast_model_type, final.update_rounding, final.optimizer_state_dtype) == (torch.bfloat16, "stochastic", "8bit")
    assert applied == {} and notes == []
    _, spelled, applied, _ = resolve("O7", optimizer_state_dtype="8bit")
    assert spelled.rows()[1:] == final.rows()[1:] and applied == {"optimizer_state_dtype": "8bit"}
    assert resolve("O7", optimizer_state_dtype="8bit", update_rounding="nearest")[1].update_rounding == "nearest"
    assert resolve("O8", optimizer_state_dtype=torch.bfloat16)[1].optimizer_state_dtype == torch.bfloat16


@pytest.mark.parametrize("level,overrides,why", [
    ("O5", dict(optimizer_state_dtype="8bit"), "master_weights=True"),
    ("O2", dict(optimizer_state_dtype="8bit"), "master_weights=True"),
    ("O0", dict(optimizer_state_dtype="8bit"), "cast_model_type=torch.float32"),
    ("O8", dict(master_weights=True), "master_weights=True"),
    ("O8", dict(update_rounding=False), "master_weights=False"),
    ("O5", dict(optimizer_state_dtype="8bit", master_weights="remainder"), "master_weights='remainder'"),
])
def test_8bit_state_without_the_transient_update_is_an_error(level, overrides, why):
    with pytest.raises(ValueError, match=r"initialize\(optimizer_state_dtype='8bit'\): .* at %s .*%s" % (level, why)):
        resolve(level, **overrides)


@pytest.mark.parametrize("value", ["8-bit", "int8", 8, torch.int8])
def test_bad_state_dtype_lists_8bit(value):
    with pytest.raises(TypeError, match=r"initialize\(optimizer_state_dtype=.*expected torch.float32, torch.bfloat16, '8bit'"):
        resolve("O7", optimizer_state_dtype=value)


KINDS = {  # level: (update, has_masters, reduces_in_fp32)
    "O0": (UpdateKind.OPTIMIZER, False, False), "O1": (UpdateKind.OPTIMIZER, False, False),
    "O2": (UpdateKind.MASTERS, True, False), "O3": (UpdateKind.OPTIMIZER, False, True),
    "O4": (UpdateKind.OPTIMIZER, False, False), "O5": (UpdateKind.MASTERS, True, False),
    "O6": (UpdateKind.MASTERS, True, False), "O7": (UpdateKind.ROUNDED, False, True),
    "O8": (UpdateKind.EIGHT_BIT, False, True),
}


@pytest.mark.parametrize("level", list(OPT_LEVELS))
def test_every_level_has_its_update_kind(level):
    """The table's row (cast marker unresolved) and the resolved properties agree."""
    assert set(KINDS) == set(OPT_LEVELS)
    final = resolve(level)[1]
    for props in (OPT_LEVELS[level], final):
        assert (props.update, props.has_masters, props.reduces_in_fp32) == KINDS[level]


@pytest.mark.parametrize("level,overrides,kind,fp32_reduce", [
    ("O5", dict(master_weights="remainder"), UpdateKind.REMAINDER, False),
    ("O6", dict(master_weights="remainder"), UpdateKind.REMAINDER, False),
    ("O7", dict(optimizer_state_dtype=torch.bfloat16), UpdateKind.ROUNDED, True),
    ("O7", dict(optimizer_state_dtype="8bit"), UpdateKind.EIGHT_BIT, True),
    ("O8", dict(optimizer_state_dtype=torch.bfloat16), UpdateKind.ROUNDED, True),
    ("O8", dict(update_rounding="nearest"), UpdateKind.EIGHT_BIT, True),
    ("O2", dict(update_rounding="nearest"), UpdateKind.MASTERS, False),  # the masters take the update
    ("O2", dict(master_weights=False, update_rounding="nearest"), UpdateKind.ROUNDED, True),
    ("O3", dict(update_rounding="nearest"), UpdateKind.ROUNDED, True),
    ("O7", dict(master_weights=True), UpdateKind.MASTERS, False),
    ("O7", dict(update_rounding=False), UpdateKind.OPTIMIZER, True),
    ("O0", dict(master_weights=True), UpdateKind.OPTIMIZER, False),  # fp32 weights are their own masters
    ("O0", dict(master_weights="remainder"), UpdateKind.OPTIMIZER, False),
    ("O1", dict(update_rounding="stochastic"), UpdateKind.OPTIMIZER, False),
])
def test_overrides_settle_the_update_kind(level, overrides, kind, fp32_reduce):
    final = resolve(level, **overrides)[1]
    assert final.update is kind
    assert final.has_masters is (kind in (UpdateKind.MASTERS, UpdateKind.REMAINDER))
    assert final.reduces_in_fp32 is fp32_reduce


def test_derived_values_are_no_options_and_do_not_change_equality_or_repr():
    props = resolve("O8")[1]
    assert {"update", "has_masters", "reduces_in_fp32"}.isdisjoint(OVERRIDES + tuple(k for k, _ in props.rows()))
    assert "update=" not in repr(props) and "eight_bit" not in format_table()
    spelled = resolve("O7", optimizer_state_dtype="8bit")[1]
    assert props != spelled and props == dataclasses.replace(spelled, opt_level="O8")
