"""use_apex_fp32_list(): Apex O1's float32 list on top of autocast, only inside an initialized
model's forward and ampkit.autocast() blocks; torch itself is never patched."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampkit
from ampkit._model.apex_lists import apex_fp32_list_enabled, use_apex_fp32_list


@pytest.fixture
def apex_list():
    previous = use_apex_fp32_list(True)
    yield
    use_apex_fp32_list(previous)


class Probe(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.seen = {}

    def forward(self, x):
        h = self.fc(x)
        self.seen.update(h=h, softmax=F.softmax(h, -1), sum=h.sum(), pow=h ** 2, mse=F.mse_loss(h, torch.zeros_like(h)),
                         log_softmax=torch.log_softmax(h, -1), norm=torch.norm(h), gelu=F.gelu(h))
        with ampkit.disable_casts():
            self.seen["outside"] = F.softmax(h, -1)
        return h


@pytest.mark.parametrize("level", ["O1", "O4"])
def test_in_the_model_forward(apex_list, level):
    model = ampkit.initialize(Probe(), opt_level=level, verbosity=0)
    half = ampkit.OPT_LEVELS[level].half_dtype
    model(torch.randn(3, 4))
    s = model.seen
    assert s["h"].dtype == half and s["gelu"].dtype == half and s["outside"].dtype == half  # not on the list / casts off
    for name in ("softmax", "sum", "pow", "mse", "log_softmax", "norm"):
        assert s[name].dtype == torch.float32, name
    torch.testing.assert_close(s["softmax"], F.softmax(s["h"].float(), -1), rtol=0, atol=0)
    assert torch.equal(s["pow"], s["h"].float() ** 2)


def test_off_by_default_and_scoped(apex_list):
    model = ampkit.initialize(Probe(), opt_level="O4", verbosity=0)
    softmax = F.softmax
    x = torch.randn(2, 4, dtype=torch.bfloat16)
    assert F.softmax(x, -1).dtype == torch.bfloat16  # outside any ampkit region: torch as usual
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert F.softmax(x, -1).dtype == torch.bfloat16  # the user's own autocast: untouched
    with ampkit.autocast():
        assert F.softmax(x, -1).dtype == torch.float32 and x.sum().dtype == torch.float32
        y = x.clone()
        y **= 2  # in place: left in its dtype
        assert y.dtype == torch.bfloat16
    assert F.softmax is softmax and torch.Tensor.sum is torch.Tensor.sum
    use_apex_fp32_list(False)
    assert not apex_fp32_list_enabled()
    model(torch.randn(3, 4))
    assert model.seen["softmax"].dtype == torch.bfloat16  # CPU autocast's own list


def test_bad_input():
    with pytest.raises(TypeError, match="use_apex_fp32_list\\(enabled='yes'\\)"):
        use_apex_fp32_list("yes")
