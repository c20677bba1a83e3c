"""``python -m ampkit.apex_compat script.py ARGS...``: unmodified Apex-era scripts (written
here) run to the end on ampkit, with exactly the results of the same scripts migrated by
hand (``import ampkit as amp``); checkpoints resume bit for bit; DDP on 2 ranks via torchrun."""
import os
import runpy
import subprocess
import sys
import types
import weakref
from pathlib import Path

import pytest
import torch

from . import scripts

pytestmark = pytest.mark.slow  # every test here starts Python subprocesses

ROOT = Path(__file__).resolve().parents[2]
NOTICE = "is standing in for NVIDIA Apex"


def _env(**extra):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    env.pop("AMPKIT_APEX", None)
    env.update(extra)
    return env


def runner(tmp_path, source, *args, ok=True, flags=(), **env):
    script = tmp_path / "train.py"
    script.write_text(source)
    cmd = [sys.executable, "-m", "ampkit.apex_compat", *flags, str(script), *map(str, args)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(**env), capture_output=True, text=True, timeout=600)
    if ok:
        assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout}\n{proc.stderr}"
        assert proc.stderr.count(NOTICE) == 1, proc.stderr
    return proc


def migrated(tmp_path, source, *args, monkeypatch):
    """The same script with its imports changed to ampkit, run in this process."""
    script = tmp_path / "train_migrated.py"
    script.write_text(scripts.migrated(source))
    monkeypatch.setattr(sys, "argv", [str(script), *map(str, args)])
    runpy.run_path(str(script), run_name="__main__")


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and torch.equal(x, y)


@pytest.mark.parametrize("level,keep_bn,scale", [("O2", "True", "128.0"), ("O5", "False", None), ("O1", None, "dynamic")])
def test_imagenet_style(tmp_path, monkeypatch, level, keep_bn, scale):
    flags = ["--opt-level", level] + (["--keep-batchnorm-fp32", keep_bn] if keep_bn else []) + (["--loss-scale", scale] if scale else [])
    out = runner(tmp_path, scripts.IMAGENET, *flags, "--steps", 4, "--out", tmp_path / "full").stdout
    full = torch.load(tmp_path / "full.0")
    assert full["opt_level"] == level and "step 3 loss" in out
    if scale == "128.0":
        assert full["scale"] == 128.0
    migrated(tmp_path, scripts.IMAGENET, *flags, "--steps", 4, "--out", tmp_path / "ref", monkeypatch=monkeypatch)
    ref = torch.load(tmp_path / "ref.0")
    _same(full["params"], ref["params"])
    assert full["losses"] == ref["losses"] and full["scale"] == ref["scale"]
    if level == "O2":  # amp.state_dict() checkpoint: 2 steps, save, resume in a new process, 2 more
        runner(tmp_path, scripts.IMAGENET, *flags, "--steps", 2, "--checkpoint", tmp_path / "ckpt.pt")
        runner(tmp_path, scripts.IMAGENET, *flags, "--steps", 4, "--resume", tmp_path / "ckpt.pt", "--out", tmp_path / "resumed")
        resumed = torch.load(tmp_path / "resumed.0")
        _same(resumed["params"], full["params"])
        assert resumed["losses"] == full["losses"][2:]


def test_gan_three_losses(tmp_path, monkeypatch):
    args = ["--opt_level", "O2", "--steps", 3, "--blowup-step", 1]
    out = runner(tmp_path, scripts.GAN, *args, "--out", tmp_path / "gan.pt").stdout
    got = torch.load(tmp_path / "gan.pt")
    assert got["scales"] == [2.0**16, 2.0**15, 2.0**16]  # only loss 1 overflowed, once
    assert got["amp"]["loss_scaler1"] == {"loss_scale": 2.0**15, "unskipped": 1}
    assert "scales [65536.0, 32768.0, 65536.0]" in out
    migrated(tmp_path, scripts.GAN, *args, "--out", tmp_path / "ref.pt", monkeypatch=monkeypatch)
    ref = torch.load(tmp_path / "ref.pt")
    _same(got["D"], ref["D"])
    _same(got["G"], ref["G"])


def test_fp16_optimizer_star_import(tmp_path, monkeypatch):
    runner(tmp_path, scripts.FP16_OPTIMIZER, 6, tmp_path / "fp16.pt")
    got = torch.load(tmp_path / "fp16.pt")
    assert got["losses"][-1] < got["losses"][0]
    assert [p.dtype for p in got["params"]] == [torch.float16, torch.float16, torch.float32, torch.float32, torch.float16, torch.float16]
    migrated(tmp_path, scripts.FP16_OPTIMIZER, 6, tmp_path / "ref.pt", monkeypatch=monkeypatch)
    ref = torch.load(tmp_path / "ref.pt")
    _same(got["params"], ref["params"])
    assert got["losses"] == ref["losses"]


def _fake_apex(tmp_path):
    pkg = tmp_path / "site" / "apex"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("REAL = True\n")
    return tmp_path / "site"


def test_installed_apex_is_never_shadowed_silently(tmp_path):
    site = _fake_apex(tmp_path)
    source = "import apex\nprint('real' if getattr(apex, 'REAL', False) else 'ampkit')\n"
    path = os.pathsep.join([str(ROOT), str(site)])
    proc = runner(tmp_path, source, ok=False, PYTHONPATH=path)
    assert proc.returncode == 2 and "a real NVIDIA Apex is installed" in proc.stderr and "--shadow-apex" in proc.stderr
    assert "AMPKIT_APEX=apex" in proc.stderr and NOTICE not in proc.stderr and proc.stdout == ""
    assert runner(tmp_path, source, PYTHONPATH=path, flags=["--shadow-apex"]).stdout == "ampkit\n"
    assert runner(tmp_path, source, PYTHONPATH=path, AMPKIT_APEX="ampkit").stdout == "ampkit\n"
    real = runner(tmp_path, source, ok=False, PYTHONPATH=path, AMPKIT_APEX="apex")
    assert real.returncode == 0 and real.stdout == "real\n" and NOTICE not in real.stderr
    beside = tmp_path / "project"  # an apex package next to the script counts too (python puts its folder first)
    (beside / "apex").mkdir(parents=True)
    (beside / "apex" / "__init__.py").write_text("REAL = True\n")
    (beside / "train.py").write_text(source)
    proc = subprocess.run([sys.executable, "-m", "ampkit.apex_compat", str(beside / "train.py")], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2 and "a real NVIDIA Apex is installed" in proc.stderr


def test_runner_usage_and_missing_parts(tmp_path):
    source = ("import sys\nfrom apex import amp\nprint(sys.argv[1:])\n"
              "try:\n    import apex.contrib.optimizers\nexcept ImportError as e:\n    print(e)\n"
              "try:\n    amp.init()\nexcept AttributeError as e:\n    print(e)\n")
    out = runner(tmp_path, source, "--opt-level", "O1", "x").stdout.splitlines()
    assert out[0] == "['--opt-level', 'O1', 'x']"
    assert "'apex.contrib'" in out[1] and "apex.contrib has no ampkit counterpart" in out[1]
    assert out[2].startswith("apex.amp.init: ") and "ampkit.initialize" in out[2]
    proc = subprocess.run([sys.executable, "-m", "ampkit.apex_compat"], env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2 and "usage: python -m ampkit.apex_compat" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "ampkit.apex_compat", str(tmp_path / "nope.py")], env=_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2 and "no such script" in proc.stderr


def test_runner_releases_the_script_and_its_process_group_at_exit(tmp_path):
    """The runner runs a script as ``__main__`` in a module it keeps; at exit (after the script's
    own atexit handlers) it drops the script's objects and destroys the process group the
    script never destroyed (Apex's examples did not), while the interpreter is whole."""
    from ampkit.apex_compat import install, uninstall
    from ampkit.apex_compat.__main__ import _release, run_script

    script = tmp_path / "train.py"
    script.write_text(
        "import pickle, sys, torch, torch.distributed as dist\n"
        "from apex.parallel import DistributedDataParallel as DDP\n"
        "class Box:\n    pass\n"
        "box = pickle.loads(pickle.dumps(Box()))  # classes of the script pickle through __main__\n"
        f"dist.init_process_group('gloo', init_method={(tmp_path / 'store').as_uri()!r}, rank=0, world_size=1)\n"
        "model = DDP(torch.nn.Linear(4, 2))\n"
        "model(torch.randn(3, 4)).sum().backward()\n"
        "main_module = sys.modules['__main__']\n"
    )
    module = types.ModuleType("__main__")
    install(True)
    try:
        run_script(str(script), module)
        ns = module.__dict__
        assert ns["__name__"] == "__main__" and ns["main_module"] is module and type(ns["box"]) is ns["Box"]
        assert sys.modules["__main__"] is not module and torch.distributed.is_initialized()
        model = weakref.ref(ns["model"])
        _release(ns)
        assert ns == {} and model() is None and not torch.distributed.is_initialized()
    finally:
        uninstall()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def test_imagenet_style_ddp_two_ranks_torchrun(tmp_path, monkeypatch):
    """``torchrun ... -m ampkit.apex_compat train.py``: each worker gets the stand-in; apex DDP with
    SyncBatchNorm on 2 ranks (half the batch each) matches one process on the whole batch."""
    script = tmp_path / "train.py"
    script.write_text(scripts.IMAGENET)
    flags = ["--opt-level", "O5", "--keep-batchnorm-fp32", "True", "--loss-scale", "1.0", "--sync_bn", "--steps", "3"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "ampkit.apex_compat", str(script), *flags, "--out", str(tmp_path / "ddp")]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    assert proc.stderr.count(NOTICE) == 2, proc.stderr  # once per worker process
    r0, r1 = torch.load(tmp_path / "ddp.0"), torch.load(tmp_path / "ddp.1")
    _same(r0["params"], r1["params"])
    migrated(tmp_path, scripts.IMAGENET, *flags, "--out", tmp_path / "single", monkeypatch=monkeypatch)
    single = torch.load(tmp_path / "single.0")
    for a, b in zip(r0["params"], single["params"]):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-3)


@pytest.mark.repo_files("examples")
def test_repository_apex_example_runs_unchanged(tmp_path):
    """examples/migrate_from_apex/train_apex.py, untouched, prints what its hand-migrated twin prints."""
    folder = ROOT / "examples" / "migrate_from_apex"
    cmd = [sys.executable, "-m", "ampkit.apex_compat", str(folder / "train_apex.py"), "--steps", "6", "--checkpoint", "a.pt"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stderr.count(NOTICE) == 1, proc.stderr
    twin = subprocess.run([sys.executable, str(folder / "train_ampkit.py"), "--steps", "6", "--checkpoint", "b.pt"],
                          cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
    assert twin.returncode == 0, twin.stderr
    assert proc.stdout == twin.stdout and "step    5  loss" in proc.stdout
    a, b = torch.load(tmp_path / "a.pt"), torch.load(tmp_path / "b.pt")
    assert a["amp"] == b["amp"]
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k])


def test_libraries_find_apex_as_they_look_for_it(tmp_path):
    """transformers-style detection (find_spec + package metadata) sees the stand-in inside the
    runner only; importing every stood-in part leaves torchao and distributed checkpoints out."""
    import ampkit

    out = runner(tmp_path, scripts.LIBRARY_CHECKS).stdout.splitlines()
    assert out == [f"apex available: 0.1+ampkit.{ampkit.__version__}", "apex distribution: ['apex']",
                   "amp holds: True True True", "heavy: []"]
    script = tmp_path / "plain.py"
    script.write_text(scripts.LIBRARY_CHECKS)
    plain = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                           timeout=600)
    assert plain.returncode == 0 and plain.stdout.splitlines() == ["apex available: False", "apex distribution: None"]


def test_vision_scaler_helper_saves_and_restores_the_loss_scale(tmp_path):
    """The helper checks `'state_dict' in amp.__dict__`: the checkpoint holds amp's state and the
    resumed run starts at the saved loss scale, not at 2**16."""
    out = runner(tmp_path, scripts.VISION_SCALER, "--steps", 4, "--blowup-step", 1, "--save", tmp_path / "c.pt").stdout
    assert "scale at start 65536.0" in out
    saved = torch.load(tmp_path / "c.pt")
    assert saved["amp"] == {"loss_scaler0": {"loss_scale": 32768.0, "unskipped": 2}}
    resumed = runner(tmp_path, scripts.VISION_SCALER, "--steps", 0, "--resume", tmp_path / "c.pt").stdout
    assert resumed.splitlines() == ["scale at start 32768.0"]


def test_fused_adam_and_amp_c_under_amp_o2_match_torch_adamw(tmp_path):
    """apex.optimizers.FusedAdam through amp.initialize(O2) steps exactly as torch.optim.AdamW
    (fused) does; amp_C's l2norm through multi_tensor_applier gives torch's gradient norm."""
    apex_run = runner(tmp_path, scripts.FUSED_ADAM, tmp_path / "apex.pt").stdout.splitlines()
    torch_run = runner(tmp_path, scripts.FUSED_ADAM, tmp_path / "torch.pt", "--torch").stdout.splitlines()
    assert apex_run[:-1] == torch_run[:-1] and len(apex_run) == 5
    assert apex_run[-1] == "overflow flag 0 FusedAdam True" and torch_run[-1] == "overflow flag 0 AdamW True"
    for line in apex_run[:-1]:
        fields = line.split()
        assert float(fields[5]) == pytest.approx(float(fields[6]), rel=1e-5) and fields[7] == "4"
    _same(torch.load(tmp_path / "apex.pt"), torch.load(tmp_path / "torch.pt"))


def test_runner_runs_a_module_pytest_included(tmp_path):
    """``python -m ampkit.apex_compat -m pytest ...``: the test session imports Apex's parts."""
    (tmp_path / "test_uses_apex.py").write_text(
        "import importlib.metadata\n"
        "from apex import amp\nfrom apex.optimizers import FusedAdam\n\n"
        "def test_apex():\n"
        "    assert importlib.metadata.version('apex').startswith('0.1+ampkit')\n"
        "    assert 'state_dict' in amp.__dict__ and FusedAdam.__module__ == 'ampkit.apex_compat.optimizers'\n")
    cmd = [sys.executable, "-m", "ampkit.apex_compat", "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_uses_apex.py"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout + proc.stderr


def test_a_script_gets_an_absolute_file_as_python_gives_it(tmp_path):
    """A script run by a relative path that changes directory still finds the file beside it."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "train.py").write_text(
        "import os\nfrom apex import amp\nprint(__file__)\nos.chdir(os.path.expanduser('~'))\n"
        "print(open(os.path.join(os.path.dirname(__file__), 'data.txt')).read())\n")
    (tmp_path / "sub" / "data.txt").write_text("beside")
    proc = subprocess.run([sys.executable, "-m", "ampkit.apex_compat", os.path.join("sub", "train.py")], cwd=tmp_path,
                          env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [str(tmp_path / "sub" / "train.py"), "beside"]


@pytest.mark.parametrize("name", ["no_such_module_xyz", "json", "no_such_package_xyz.sub", "json.no_such_sub"])
def test_a_missing_module_gets_pythons_own_line(tmp_path, name):
    ours = subprocess.run([sys.executable, "-m", "ampkit.apex_compat", "-m", name], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=600)
    python = subprocess.run([sys.executable, "-m", name], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                            timeout=600)
    assert python.returncode == 1 and python.stderr.count("\n") == 1  # Python's one line
    assert ours.returncode == 1 and ours.stderr.splitlines()[-1] == python.stderr.strip()
    assert "Traceback" not in ours.stderr and ours.stdout == ""
