"""What initialize attaches to a model: here, the swapped class's ``forward`` keeps the model's signature."""
import copy
import inspect

import pytest
import torch
from torch import nn

import ampkit


class Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, input_ids, attention_mask=None, labels=None):
        """The docstring of the model's own forward."""
        return self.head(self.embed(input_ids)).sum(1)


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3", "O4", "O5", "O7", "O8"])
def test_forward_keeps_the_models_signature_and_still_casts(level):
    model = Tagger()
    expected = inspect.signature(model.forward)
    model, _ = ampkit.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level=level, verbosity=0)
    # transformers' Trainer keeps only the batch columns this signature names (remove_unused_columns)
    assert inspect.signature(model.forward) == expected
    assert list(inspect.signature(copy.deepcopy(model).forward).parameters) == ["input_ids", "attention_mask", "labels"]
    assert model.forward.__doc__ == Tagger.forward.__doc__
    assert isinstance(model, Tagger) and type(model).__name__ == "Tagger"
    out = model(torch.tensor([[1, 2], [3, 4]]))
    assert out.dtype == torch.float32 and out.shape == (2, 3)  # outputs cast back to fp32 at every level
