"""The step protocol: one stage per optimizer, changed only by OptimizerState's methods, with
an error naming the call when a loop breaks the order."""
import pytest
import torch
from torch import nn

import ampkit
from ampkit._optim.optimizer_state import Stage


def build(level="O2", **kw):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return ampkit.initialize(model, opt, opt_level=level, verbosity=0, **kw)


def loss_of(model):
    return model(torch.ones(2, 4)).float().pow(2).mean()


@pytest.mark.parametrize("level", ["O1", "O2", "O5", "O7"])
def test_a_plain_step_goes_ready_block_unscaled_ready(level):
    model, opt = build(level)
    st = opt._ampkit
    assert st.stage is Stage.READY
    with ampkit.scale_loss(loss_of(model), opt) as scaled:
        assert st.stage is Stage.IN_BLOCK
        scaled.backward()
    assert st.stage is Stage.UNSCALED
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    assert st.stage is Stage.READY
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_delay_unscale_holds_the_window_scaled_until_step():
    model, opt = build("O2")
    st = opt._ampkit
    with ampkit.scale_loss(loss_of(model), opt, delay_unscale=True) as scaled:
        scaled.backward()
    assert st.stage is Stage.SCALED and st.scaled_by is ampkit.loss_scalers(opt)[0]
    with ampkit.scale_loss(loss_of(model), opt) as scaled:
        scaled.backward()
    assert st.stage is Stage.UNSCALED and st.scaled_by is None
    opt.zero_grad()
    assert st.stage is Stage.READY


def test_step_inside_the_block_is_refused_naming_the_call():
    model, opt = build("O2")
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"SGD.step\(\) was called inside `with ampkit.scale_loss\(...\)`"):
        with ampkit.scale_loss(loss_of(model), opt) as scaled:
            scaled.backward()
            opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert opt._ampkit.stage is Stage.SCALED  # the block was left by an error: its gradients stay scaled
    opt.zero_grad()
    assert opt._ampkit.stage is Stage.READY


def test_nested_blocks_on_one_optimizer_are_refused():
    model, opt = build("O1")
    with ampkit.scale_loss(loss_of(model), opt) as scaled:
        with pytest.raises(RuntimeError, match="already inside an enclosing `with ampkit.scale_loss"):
            with ampkit.scale_loss(loss_of(model), opt):
                pass
        scaled.backward()
    assert opt._ampkit.stage is Stage.UNSCALED


def test_a_loss_that_reaches_none_of_the_optimizers_parameters_is_refused():
    model, opt = build("O2")
    other, other_opt = build("O2")  # another experiment in the same notebook
    with pytest.raises(RuntimeError, match=r"reached none of the parameters of SGD \(4 parameters\).*loss scale 65536"):
        with ampkit.scale_loss(loss_of(model), other_opt) as scaled:
            scaled.backward()
    assert all(p.grad is not None for p in model.parameters())  # the real model's scaled gradients
    with pytest.raises(RuntimeError, match=r"scaled_loss.backward\(\) was not called"):
        with ampkit.scale_loss(loss_of(other), other_opt):
            pass


def test_another_losses_window_must_close_first():
    model, opt = build("O2", num_losses=2)
    with ampkit.scale_loss(loss_of(model), opt, loss_id=0, delay_unscale=True) as scaled:
        scaled.backward()
    with pytest.raises(RuntimeError, match=r"scale_loss\(loss_id=1\): the optimizer still holds gradients scaled by another"):
        with ampkit.scale_loss(loss_of(model), opt, loss_id=1):
            pass
    assert opt._ampkit.stage is Stage.SCALED


def test_flags_are_written_only_by_the_state_itself():
    """No module writes OptimizerState's protocol fields from outside the class."""
    import ast
    from pathlib import Path

    import ampkit as pkg

    fields = {"stage", "scaled_by", "window", "pending", "skip", "unstepped", "stash", "keep_grads", "last_step_skipped"}
    root = Path(pkg.__file__).parent
    offenders = []
    for path in root.rglob("*.py"):
        if path.name == "optimizer_state.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for t in targets:
                if isinstance(t, ast.Attribute) and t.attr in fields and not (isinstance(t.value, ast.Name) and t.value.id == "self"):
                    offenders.append(f"{path.relative_to(root)}:{node.lineno} .{t.attr}")
    assert offenders == []
