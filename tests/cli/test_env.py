"""``ampkit env`` and ``ampkit kernels --build``: the kernels' status (or the build's errors), the
machine, and every ``AMPKIT_*`` switch with its value."""
import pytest

from ampkit._cli import cli
from ampkit._common.switches import SWITCHES
from ampkit._kernels import native


@pytest.fixture(autouse=True)
def _no_probe(monkeypatch, tmp_path):
    monkeypatch.setenv("AMPKIT_PROBE", "0")
    monkeypatch.setenv("AMPKIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(native, "_state", {})


def test_env_names_every_switch_with_its_value_and_the_kernels(lib, capsys, monkeypatch, tmp_path):
    for name in ("AMPKIT_NATIVE", "AMPKIT_COMPILED_UPDATE", "AMPKIT_APEX"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AMPKIT_FUSED", "0")
    assert cli.main(["env"]) == 0
    out = capsys.readouterr().out
    for s in SWITCHES:
        value = {"AMPKIT_FUSED": "0", "AMPKIT_PROBE": "0", "AMPKIT_CACHE_DIR": str(tmp_path / "cache")}.get(s.name, s.default)
        assert f"  {s.name}={value!r} (default {s.default!r}): {s.meaning}" in out
    assert "kernels: built: " + native._state["path"] in out and "OpenMP: yes" in out
    assert "compiler: " in out and "capabilities: cpu" in out and "AMPKIT_PROBE=0" in out


def test_a_failed_build_shows_its_compiler_errors_in_env(capsys, monkeypatch, tmp_path):
    cc = tmp_path / "cc"  # a compiler that fails with an error log
    cc.write_text("#!/bin/sh\necho 'kernels.c:1: error: no such thing' >&2\necho 'second line' >&2\nexit 1\n")
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    assert cli.main(["env"]) == 0
    out = capsys.readouterr().out
    assert "kernels: not built: " in out and "kernels.c:1: error: no such thing" in out and "  second line" in out
    assert cli.main(["kernels", "--build"]) == 1
    assert "kernels.c:1: error: no such thing" in capsys.readouterr().out


def test_kernels_build_says_where_and_what(lib, capsys):
    assert cli.main(["kernels", "--build"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "kernels: built: " + native._state["path"] and native._state["path"].startswith(native.cache_dir())
    assert out[1].startswith("sources: adamw.c, ") and out[2] == "functions: " + ", ".join(native.lib.SYMBOLS)


def test_a_name_that_is_not_a_switch_is_an_error_naming_the_switches():
    from ampkit._common import switches

    with pytest.raises(ValueError, match="name='AMPKIT_FUSD' is not a switch; expected one of AMPKIT_FUSED, "):
        switches.get("AMPKIT_FUSD")
