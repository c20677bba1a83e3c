"""The docs' op table for O1/O4 (docs/training-loops.md, "Which ops run in half"): the CPU columns are
measured here on this torch (float16 and bfloat16), with and without Apex's float32 list;
the CUDA column when a GPU is present."""
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampkit
from ampkit._model.apex_lists import use_apex_fp32_list

PAGE = Path(__file__).resolve().parents[2] / "docs" / "training-loops.md"
pytestmark = pytest.mark.repo_files("docs/training-loops.md")
W = torch.randn(4, 4)
IDX = torch.zeros(4, dtype=torch.long)

OPS = {  # table row -> the op, on a 4x4 floating input
    "`F.linear`, `matmul`, `@`": lambda x: F.linear(x, W.to(x.device)),
    "`conv1d/2d/3d`": lambda x: F.conv2d(x.view(1, 1, 4, 4), W.to(x.device).view(1, 1, 4, 4)),
    "`bmm`, `baddbmm`": lambda x: torch.bmm(x[None], x[None]),
    "`softmax`": lambda x: F.softmax(x, -1),
    "`log_softmax`": lambda x: F.log_softmax(x, -1),
    "`sum`": lambda x: x.sum(),
    "`pow`, `**`": lambda x: x.pow(2),
    "`exp`, `log`": lambda x: torch.exp(x),
    "`cumsum`": lambda x: torch.cumsum(x, 0),
    "`prod`": lambda x: torch.prod(x),
    "`norm`": lambda x: torch.norm(x),
    "`F.normalize`": lambda x: F.normalize(x),
    "`layer_norm`": lambda x: F.layer_norm(x, (4,)),
    "`group_norm`": lambda x: F.group_norm(x, 2),
    "`batch_norm`": lambda x: F.batch_norm(x, None, None, training=True),
    "`relu`, `gelu`": lambda x: F.gelu(x),
    "`mse_loss`, `l1_loss`": lambda x: F.mse_loss(x, torch.zeros_like(x)),
    "`cross_entropy`, `nll_loss`": lambda x: F.cross_entropy(x, IDX.to(x.device)),
    "`binary_cross_entropy_with_logits`": lambda x: F.binary_cross_entropy_with_logits(x, torch.ones_like(x)),
}
RECURRENT = {
    "`nn.LSTM`, `nn.GRU`, `nn.RNN`": lambda: nn.LSTM(4, 4),
    "`nn.LSTMCell`, `nn.GRUCell`": lambda: nn.LSTMCell(4, 4),
    "`nn.RNNCell`": lambda: nn.RNNCell(4, 4),
}
COLUMNS = ("op", "apex", "cuda", "cpu", "cpu_apex_list")


def readme_rows():
    text = PAGE.read_text()
    section = text.split("## Autocast levels (O1/O4): which ops run in half", 1)[1].split("\n#", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == len(COLUMNS) and cells[0].startswith("`"):
            rows[cells[0]] = dict(zip(COLUMNS, cells))
    return rows


def category(fn, device, half) -> str:
    """'half' (cast down), 'fp32' (cast up), or 'input' (runs in the input's dtype)."""
    with torch.autocast(device, dtype=half):
        if fn(torch.randn(4, 4, device=device)).dtype == half:
            return "half"
        return "fp32" if fn(torch.randn(4, 4, device=device).to(half)).dtype == torch.float32 else "input"


def recurrent_category(make, device, level) -> str:
    """Inside an initialized model's forward at ``level``, fed the autocast dtype."""
    seen = []

    class Probe(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = make()

        def forward(self, x):
            out = self.layer(x)
            seen.append((out[0] if isinstance(out, tuple) else out).dtype)
            return x

    ampkit.initialize(Probe().to(device), opt_level=level, verbosity=0)(torch.randn(3, 4, device=device))
    half = ampkit.OPT_LEVELS[level].half_dtype
    return "half" if seen[0] == half else "fp32"


def test_table_lists_every_op():
    assert set(readme_rows()) == set(OPS) | set(RECURRENT)


def _cell(text):
    return text.split()[0].strip("*")


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16])
def test_cpu_columns_are_what_torch_does(half):
    rows = readme_rows()
    for name, fn in OPS.items():
        assert category(fn, "cpu", half) == _cell(rows[name]["cpu"]), name
        previous = use_apex_fp32_list(True)
        try:
            got = _switched_category(fn, "cpu", half)
        finally:
            use_apex_fp32_list(previous)
        assert got == _cell(rows[name]["cpu_apex_list"]), name
    level = "O1" if half == torch.float16 else "O4"
    for name, make in RECURRENT.items():
        assert recurrent_category(make, "cpu", level) == _cell(rows[name]["cpu"]), name


def _switched_category(fn, device, half):
    """``category`` inside an ampkit autocast region with Apex's float32 list switched on."""
    from ampkit._model.apex_lists import apex_fp32_region

    with apex_fp32_region():
        return category(fn, device, half)


def test_apex_list_column_is_apex_for_its_fp32_ops():
    """Where Apex O1 ran an op in float32, the switch does too (on CPU)."""
    for name, row in readme_rows().items():
        if _cell(row["apex"]) == "fp32":
            assert _cell(row["cpu_apex_list"]) == "fp32", name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_column():
    rows = readme_rows()
    for name, fn in OPS.items():
        assert category(fn, "cuda", torch.float16) == _cell(rows[name]["cuda"]), name
    for name, make in RECURRENT.items():
        assert recurrent_category(make, "cuda", "O1") == _cell(rows[name]["cuda"]), name
