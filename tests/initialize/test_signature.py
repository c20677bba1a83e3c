"""``initialize``'s written-out signature is the option table: names, order, defaults and kinds, and
its docstring describes every argument with the values the checks accept."""
import inspect
import re

import torch
from torch import nn

import ampkit
from ampkit._config.levels import REMAINDER, STATE_8BIT
from ampkit._config.options import OPTIONS
from ampkit._run.registry import of_model

P = inspect.Parameter


def test_the_signature_is_the_option_table():
    params = list(inspect.signature(ampkit.initialize).parameters.values())
    head = [(p.name, p.default, p.kind) for p in params[:4]]
    assert head == [("models", P.empty, P.POSITIONAL_OR_KEYWORD), ("optimizers", None, P.POSITIONAL_OR_KEYWORD),
                    ("enabled", True, P.POSITIONAL_OR_KEYWORD), ("opt_level", None, P.POSITIONAL_OR_KEYWORD)]
    # Apex's order and kinds: every option may also be passed by position, as Apex scripts do
    assert [(p.name, p.default, p.kind) for p in params[4:]] == [(o.name, o.default, P.POSITIONAL_OR_KEYWORD)
                                                                for o in OPTIONS]
    assert all(p.annotation is not P.empty for p in params), "every parameter is typed"


def arg_docs() -> dict:
    doc = inspect.getdoc(ampkit.initialize)
    section = doc.split("\nArgs:\n", 1)[1].split("\n\nReturns:", 1)[0]
    return {m[1]: m[2] for m in re.finditer(r"^    (\w+): (.*?)(?=^    \w+: |\Z)", section, re.M | re.S)}


def test_the_docstring_describes_every_argument_and_names_the_accepted_values():
    docs = arg_docs()
    assert list(docs) == list(inspect.signature(ampkit.initialize).parameters)
    level_options = {o.name for o in OPTIONS if o.level}
    for name, text in docs.items():
        assert (text.startswith("(level)")) == (name in level_options), name
    assert f'"{REMAINDER}"' in docs["master_weights"] and "`False`" in docs["master_weights"]
    assert "`False`" in docs["update_rounding"] and '"stochastic"' in docs["update_rounding"]
    assert f'"{STATE_8BIT}"' in docs["optimizer_state_dtype"] and '"emulate"' in docs["fp8"]
    assert all(f'"{level}"' in docs["opt_level"] for level in [*ampkit.OPT_LEVELS, "auto"])
    doc = inspect.getdoc(ampkit.initialize)
    assert "\nReturns:\n" in doc and "\nRaises:\n" in doc


def test_an_option_passed_by_position_lands_where_apex_puts_it():
    """``initialize(model, opt, True, "O2", None, None, None, False)``: master_weights, 8th."""
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = ampkit.initialize(model, opt, True, "O2", None, None, None, False, verbosity=0)
    assert of_model("test", model).properties.master_weights is False
