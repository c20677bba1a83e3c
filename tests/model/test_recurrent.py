"""nn.LSTM/GRU/RNN at O1/O4 on CPU: they run in float32 under autocast (oneDNN has no float16
LSTM), and training matches a hand-written autocast loop that does the same."""
import copy
import io

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

import ampkit
from ampkit._run.registry import current as current_run

LEVELS = {"O1": torch.float16, "O4": torch.bfloat16}


class Tagger(nn.Module):
    def __init__(self, cell=nn.LSTM):
        super().__init__()
        self.emb = nn.Linear(4, 6)
        self.rnn = cell(6, 5, batch_first=True)
        self.out = nn.Linear(5, 3)
        self.seen = []

    def forward(self, x):
        h, _ = self.rnn(self.emb(x))
        self.seen.append((h.dtype, torch.is_autocast_enabled("cpu")))
        return self.out(h)


def batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(2, 3, 4, generator=g), torch.randn(2, 3, 3, generator=g)


@pytest.mark.parametrize("cell", [nn.LSTM, nn.GRU, nn.RNN])
@pytest.mark.parametrize("level", ["O1", "O4"])
def test_trains_like_a_hand_written_loop(level, cell):
    half = LEVELS[level]
    torch.manual_seed(0)
    model = Tagger(cell)
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    model, opt = ampkit.initialize(model, opt, opt_level=level, verbosity=0)
    scale = current_run("t").scalers[0].loss_scale()
    for step in range(3):
        x, y = batch(step)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        with ampkit.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        # by hand: autocast around the model, the recurrent layer in float32 outside it
        ref_opt.zero_grad()
        with torch.autocast("cpu", dtype=half):
            e = ref.emb(x)
            with torch.autocast("cpu", enabled=False):
                h, _ = ref.rnn(e.float())
            out = ref.out(h)
        ref_loss = nn.functional.mse_loss(out.float(), y)
        (ref_loss * scale).backward()
        for p in ref.parameters():
            p.grad.mul_(1.0 / scale)
        ref_opt.step()
        assert loss.item() == ref_loss.item()
    assert model.seen == [(torch.float32, True)] * 3  # float32 out, and autocast back on after the layer
    for p, r in zip(model.parameters(), ref.parameters()):
        assert p.dtype == torch.float32 and torch.equal(p, r)


def test_packed_sequences_copies_and_errors():
    lstm = nn.LSTM(4, 5)
    lstm = ampkit.initialize(lstm, opt_level="O1", verbosity=0)  # the model itself is the layer
    packed = pack_padded_sequence(torch.randn(3, 2, 4), torch.tensor([3, 2]))
    out, (h, c) = lstm(packed)
    assert out.data.dtype == torch.float32 and h.dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.float16):
        with pytest.raises(RuntimeError):
            lstm(torch.randn(3, 2, 7))  # wrong input size: raises inside the layer
        assert torch.is_autocast_enabled("cpu")  # the hook left autocast as it found it
        assert lstm(torch.randn(3, 2, 4).half())[0].dtype == torch.float32
    for clone in (copy.deepcopy(lstm), _pickled(lstm)):
        assert clone(torch.randn(3, 2, 4))[0].dtype == torch.float32


def _pickled(module):
    buf = io.BytesIO()
    torch.save(module, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def test_untouched_outside_autocast_levels():
    torch.manual_seed(0)
    model = ampkit.initialize(Tagger(), opt_level="O5", verbosity=0)
    model(torch.randn(2, 3, 4))
    assert model.seen == [(torch.bfloat16, False)]
    plain = nn.LSTM(4, 5)
    ampkit.initialize(nn.Linear(2, 2), opt_level="O4", verbosity=0)
    assert not plain._forward_pre_hooks
