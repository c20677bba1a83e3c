"""``import ampkit`` stays lean: heavy optional modules load only when used."""
import subprocess
import sys

import pytest

HEAVY = ("torchao", "torch.distributed.checkpoint", "torch.distributed.fsdp",
         "lightning", "pytorch_lightning", "accelerate", "transformers")  # the frameworks: ampkit.integrations only


@pytest.mark.parametrize("statement", [
    "import ampkit", "import ampkit; ampkit.initialize; ampkit.scale_loss",
    "import ampkit.integrations; from ampkit.integrations import schedulers",
    "import ampkit.apex_compat as c; c.install(); from apex import amp, optimizers, parallel, fp16_utils",
])
def test_import_does_not_pull_in_heavy_modules(statement):
    code = f"import sys; {statement}; print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"


def test_version_and_help_need_no_torch():
    code = "import sys, ampkit; ampkit.__version__; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "False"
