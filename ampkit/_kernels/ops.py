"""The fused update steps as declared torch ops (``torch.ops.ampkit.*``), each declared once here
with its fake (for ``torch.compile``) and its CPU implementation: the op's module (``fused_*.py``),
where the eager reference and the C kernel sit side by side, running the kernel where it is
built. Design: ``docs/design/kernels.md``.
"""
import dataclasses

import torch

from . import fused_adamw, fused_adamw_8bit, fused_masters, fused_sgd, fused_sgd_8bit, fused_sgd_remainder, native
from .fused_adamw import Hyper
from .remainder import set_side_table, side_table

__all__ = ["adamw_steps_", "master_steps_", "remainder_steps_", "adamw_8bit_steps_", "sgd_steps_", "sgd_master_steps_",
           "sgd_remainder_steps_", "sgd_8bit_steps_"]


_NO_TABLE = torch.empty(0, dtype=torch.int64)  # the op's argument for a CPU remainder without a table (only read)
_NO_WEIGHT = torch.empty(0, dtype=torch.bfloat16)  # a master op's ``w[i]`` for a float32 parameter (only read)


def _table_arg(r: torch.Tensor) -> torch.Tensor:
    """``r``'s side table as a remainder op's argument (`_NO_TABLE` for a CPU remainder without one)."""
    return side_table(r, _NO_TABLE if r.is_cpu else None)


def _hyper(hyper: list, flags: list, count: torch.Tensor) -> Hyper:
    return Hyper(*hyper, *flags, count.item())


def _values(hyper: Hyper) -> tuple:
    """The ops' ``hyper`` (lr, beta1, beta2, eps, weight_decay) and ``flags`` (decoupled, maximize)."""
    return [hyper.lr, hyper.beta1, hyper.beta2, hyper.eps, hyper.weight_decay], [hyper.decoupled, hyper.maximize]


# Declared with torch.library.Library, not torch.library.custom_op: custom_op's Python wrapper cost
# 37 us a call here (2.4-3x O5's, O7's and O8's whole optimizer step on a model of 200 small tensors);
# the same schema, CPU implementation and fake through the dispatcher cost 3 us.
_LIB = torch.library.Library("ampkit", "DEF")


_IMPLS = {}  # name -> CPU implementation, for `_run`


def _declare(schema: str, impl, fake) -> None:
    """Define ``ampkit::<schema>`` with its CPU implementation ``impl`` and its fake (for tracing)."""
    name = schema.split("(", 1)[0]
    _LIB.define(schema)
    _LIB.impl(name, impl, "CPU")
    torch.library.register_fake(f"ampkit::{name}", fake, lib=_LIB)
    _IMPLS[name] = impl


def _run(name: str, *args):
    """``torch.ops.ampkit.<name>(*args)`` on CPU tensors: through the dispatcher where anything
    may see the call (``torch.compile`` tracing, a dispatch or function mode, the profiler), else
    its CPU implementation called directly, which is what the dispatcher would run: right after a
    backward pass the dispatcher's way in cost 65-75 us a call here (3 us warm)."""
    if (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack()
            or torch._C._is_torch_function_mode_enabled() or torch._C._autograd._profiler_enabled()):
        return getattr(torch.ops.ampkit, name)(*args)
    return _IMPLS[name](*args)


def adamw_bf16(w, grad, m, v, count, hyper, flags, seed, step, tensor, first) -> None:
    """O7's step (`fused_adamw.steps_`) of each bf16 ``w[i]`` from element ``first[i]`` on (its
    gradient, state, ``tensor[i]``); ``count[i]``: its step count (this step included);
    ``hyper``: lr, beta1, beta2, eps, weight_decay; ``flags``: decoupled, maximize. One call
    steps the tensors of a param group: the dispatcher's cost once, not per tensor."""
    fused_adamw.steps_([(w[i], grad[i], m[i], v[i], _hyper(hyper, flags, count[i]), tensor[i], first[i])
                        for i in range(len(w))], seed, step, native.library())


_declare("adamw_bf16(Tensor(a!)[] w, Tensor[] grad, Tensor(b!)[] m, Tensor(c!)[] v, Tensor[] count, float[] hyper, "
         "bool[] flags, int seed, int step, int[] tensor, int[] first) -> ()",
         adamw_bf16, lambda w, grad, m, v, count, hyper, flags, seed, step, tensor, first: None)


def _weight(w: list, i: int):
    """A master op's bf16 weight of tensor ``i``: None where ``w`` is empty (no tensor has one) or
    ``w[i]`` is (a float32 parameter, `_NO_WEIGHT`; a zero-size master has nothing to write)."""
    return w[i] if w and w[i].numel() else None


def adamw_master(x, grad, m, v, w, count, hyper, flags) -> None:
    """O5's step of each float32 master ``x[i]`` and its bf16 model weight ``w[i]`` (`_weight`)
    (`fused_masters.steps_master_`); ``count``, ``hyper``, ``flags`` as `adamw_bf16`'s."""
    fused_masters.steps_master_([(x[i], grad[i], m[i], v[i], _hyper(hyper, flags, count[i]), _weight(w, i))
                                 for i in range(len(x))], native.library())


_declare("adamw_master(Tensor(a!)[] x, Tensor[] grad, Tensor(b!)[] m, Tensor(c!)[] v, Tensor(d!)[] w, "
         "Tensor[] count, float[] hyper, bool[] flags) -> ()",
         adamw_master, lambda x, grad, m, v, w, count, hyper, flags: None)


def adamw_remainder(w, r, grad, m, v, table, count, hyper, flags) -> tuple:
    """The remainder masters' step (`fused_masters.steps_remainder_table_`) of each ``(w[i], r[i])`` with
    ``r[i]``'s side table ``table[i]`` (``count``, ``hyper``, ``flags`` as `adamw_bf16`'s); returns
    the new side tables (`_tables`: arguments and results, not ``r``'s attribute, as a traced op may
    be handed copies of its arguments). One call steps a param group's tensors."""
    return _tables(fused_masters.steps_remainder_table_([(w[i], r[i], grad[i], m[i], v[i], _hyper(hyper, flags, count[i]),
                                                          table[i]) for i in range(len(w))], native.library()))


def _tables(tables: list) -> tuple:
    """A remainder op's result: its new side tables concatenated, and each one's size (two int64
    tensors: torch cannot functionalize an op that returns a list of them)."""
    sizes = [t.numel() for t in tables]
    if not any(sizes):  # the usual step: no entries anywhere
        return torch.empty(0, dtype=torch.int64), torch.zeros(len(sizes), dtype=torch.int64)
    return torch.cat(tables), torch.tensor(sizes, dtype=torch.int64)


def _new_tables(table: list) -> tuple:
    """A remainder op's fake result: the new side tables (concatenated, a size known only when the
    op ran) and their sizes."""
    return table[0].new_empty(torch.library.get_ctx().new_dynamic_size()), table[0].new_empty(len(table))


_declare("adamw_remainder(Tensor(a!)[] w, Tensor(b!)[] r, Tensor[] grad, Tensor(c!)[] m, Tensor(d!)[] v, "
         "Tensor[] table, Tensor[] count, float[] hyper, bool[] flags) -> (Tensor, Tensor)",
         adamw_remainder, lambda w, r, grad, m, v, table, count, hyper, flags: _new_tables(table))


def adamw_8bit(w, grad, mq, ms, vq, vs, backup, count, hyper, flags, cap, seed, step, tensor, first) -> torch.Tensor:
    """O8's step (`fused_adamw_8bit.steps_`) of each tensor ``w[i]`` in turn (its gradient, codes,
    scales, step count ``count[i]``, ``cap[i]``, ``tensor[i]``, ``first[i]``; ``backup`` five
    buffers each), stopping at the first whose new weight would not be finite (it wrote nothing,
    its old values are in its backup); returns how many wrote (an int64 tensor). One call steps
    the tensors of a chunk: the dispatcher's cost once, not per tensor."""
    items = [(w[i], grad[i], mq[i], ms[i], vq[i], vs[i], _hyper(hyper, flags, count[i]), cap[i], tensor[i], first[i],
              tuple(backup[5 * i:5 * i + 5])) for i in range(len(w))]
    return torch.tensor(fused_adamw_8bit.steps_(items, seed, step, native.library()))


_declare("adamw_8bit(Tensor(a!)[] w, Tensor[] grad, Tensor(b!)[] mq, Tensor(c!)[] ms, Tensor(d!)[] vq, "
         "Tensor(e!)[] vs, Tensor(f!)[] backup, Tensor[] count, float[] hyper, bool[] flags, float[] cap, int seed, "
         "int step, int[] tensor, int[] first) -> Tensor",
         adamw_8bit, lambda *args: torch.empty((), dtype=torch.int64))


def _sgd(hyper: list, flags: list) -> fused_sgd.Hyper:
    return fused_sgd.Hyper(*hyper, *flags)


def _sgd_values(hyper: fused_sgd.Hyper) -> tuple:
    """The SGD ops' ``hyper`` (lr, momentum, dampening, weight_decay) and ``flags`` (nesterov, maximize)."""
    return [hyper.lr, hyper.momentum, hyper.dampening, hyper.weight_decay], [hyper.nesterov, hyper.maximize]


def sgd_bf16(w, grad, buf, hyper, flags, new, seed, step, tensor, first) -> None:
    """O7's SGD step (`fused_sgd.steps_`) of each bf16 ``w[i]`` from element ``first[i]`` on;
    ``buf[i]``: its momentum buffer (``buf`` empty when momentum is 0), made from the gradient
    when ``new[i]``. One call steps the tensors of a param group."""
    fused_sgd.steps_([(w[i], grad[i], buf[i] if buf else None, new[i], tensor[i], first[i]) for i in range(len(w))],
                     _sgd(hyper, flags), seed, step, native.library())


_declare("sgd_bf16(Tensor(a!)[] w, Tensor[] grad, Tensor(b!)[] buf, float[] hyper, bool[] flags, bool[] new, "
         "int seed, int step, int[] tensor, int[] first) -> ()",
         sgd_bf16, lambda w, grad, buf, hyper, flags, new, seed, step, tensor, first: None)


def sgd_master(x, grad, buf, w, hyper, flags, new) -> None:
    """O5's SGD step of each float32 master ``x[i]`` and its bf16 model weight ``w[i]``
    (`fused_sgd.steps_master_`; ``buf`` empty: none; ``w`` as `_weight` reads it)."""
    fused_sgd.steps_master_([(x[i], grad[i], buf[i] if buf else None, new[i], _weight(w, i))
                             for i in range(len(x))], _sgd(hyper, flags), native.library())


_declare("sgd_master(Tensor(a!)[] x, Tensor[] grad, Tensor(b!)[] buf, Tensor(c!)[] w, float[] hyper, bool[] flags, "
         "bool[] new) -> ()",
         sgd_master, lambda x, grad, buf, w, hyper, flags, new: None)


def sgd_remainder(w, r, grad, buf, table, hyper, flags, new) -> tuple:
    """The remainder masters' SGD step (`fused_sgd_remainder.steps_table_`) of each ``(w[i], r[i])``
    with ``r[i]``'s side table ``table[i]`` (``buf`` as `sgd_bf16`'s); returns the new side tables
    (as `adamw_remainder`). One call steps a param group's tensors."""
    return _tables(fused_sgd_remainder.steps_table_([(w[i], r[i], grad[i], buf[i] if buf else None, new[i], table[i])
                                                     for i in range(len(w))], _sgd(hyper, flags), native.library()))


_declare("sgd_remainder(Tensor(a!)[] w, Tensor(b!)[] r, Tensor[] grad, Tensor(c!)[] buf, Tensor[] table, "
         "float[] hyper, bool[] flags, bool[] new) -> (Tensor, Tensor)",
         sgd_remainder, lambda w, r, grad, buf, table, hyper, flags, new: _new_tables(table))


def sgd_8bit(w, grad, bq, bs, backup, hyper, flags, new, seed, step, tensor, first) -> torch.Tensor:
    """O8's SGD step (`fused_sgd_8bit.steps_`) of each ``w[i]`` in turn, the buffer as codes
    ``bq[i]`` and scales ``bs[i]`` (``backup``: three buffers each), stopping at the first whose
    new weight would not be finite (as `adamw_8bit`); returns how many wrote (an int64 tensor)."""
    items = [(w[i], grad[i], bq[i], bs[i], new[i], tensor[i], first[i], tuple(backup[3 * i:3 * i + 3]))
             for i in range(len(w))]
    return torch.tensor(fused_sgd_8bit.steps_(items, _sgd(hyper, flags), seed, step, native.library()))


_declare("sgd_8bit(Tensor(a!)[] w, Tensor[] grad, Tensor(b!)[] bq, Tensor(c!)[] bs, Tensor(d!)[] backup, "
         "float[] hyper, bool[] flags, bool[] new, int seed, int step, int[] tensor, int[] first) -> Tensor",
         sgd_8bit, lambda *args: torch.empty((), dtype=torch.int64))


def _all_or_none(name: str, tensors: list) -> list:
    """``tensors`` as an op's optional list argument: all of them, or ``[]`` where all are None."""
    given = [t for t in tensors if t is not None]
    if given and len(given) != len(tensors):
        raise ValueError(f"ops: {name} for every tensor of a group or for none, got {len(given)} of {len(tensors)}.")
    return given


def _kernel_runs(steps: list, at: int) -> tuple:
    """``steps`` split by their element ``at``, the first element's index: ``(those where it is an
    int, the C kernel's case; the others, whose every element's index is a tensor)``."""
    return native.split(steps, lambda s: isinstance(s[at], int))


def adamw_steps_(steps: list, hyper: Hyper, seed: int, step: int) -> None:
    """`fused_adamw.step_` of each ``(w, grad, m, v, count, tensor, index)`` of ``steps`` (CPU
    tensors of one group) with ``hyper`` at step ``count`` (a tensor, read in the op:
    ``hyper.step`` is not used): the declared op, once, for those whose ``index`` is an int (the C
    kernel's case), the eager reference for the others."""
    runs, others = _kernel_runs(steps, 6)
    for w, grad, m, v, count, tensor, index in others:
        fused_adamw.step_(w, grad, m, v, dataclasses.replace(hyper, step=count.item()), seed, step, tensor, index)
    if runs:
        w, grad, m, v, count, tensor, first = (list(column) for column in zip(*runs))
        _run("adamw_bf16", w, grad, m, v, count, *_values(hyper), seed, step, tensor, first)


def master_steps_(steps: list, hyper: Hyper) -> None:
    """`fused_masters.step_master_` of each ``(x, grad, m, v, count, w)`` of ``steps`` (CPU tensors
    of one group, at step ``count`` as `adamw_steps_`'s; ``w`` None: a float32 parameter, no
    weight to write), as the op."""
    if steps:
        x, grad, m, v, count, w = (list(column) for column in zip(*steps))
        _run("adamw_master", x, grad, m, v, _weights(w), count, *_values(hyper))


def _weights(w: list) -> list:
    """A master op's ``w``: ``[]`` where every tensor has none, else each one's (`_NO_WEIGHT` for None)."""
    return [_NO_WEIGHT if t is None else t for t in w] if any(t is not None for t in w) else []


def remainder_steps_(steps: list, hyper: Hyper) -> None:
    """`fused_masters.step_remainder_` of each ``(w, r, grad, m, v, count)`` of ``steps`` (CPU
    tensors of one group, at step ``count`` as `adamw_steps_`'s), as the op."""
    if steps:
        w, r, grad, m, v, count = (list(column) for column in zip(*steps))
        _set_tables(r, _run("adamw_remainder", w, r, grad, m, v, [_table_arg(x) for x in r], count,
                            *_values(hyper)))


def _set_tables(remainders: list, result: tuple) -> None:
    """Each of ``remainders`` its new side table from a remainder op's ``result`` (`_tables`), a
    copy where it has entries: a table owns its entries, not the others'."""
    entries, sizes = result
    if not entries.numel():  # the usual step: no table anywhere, no views to cut
        for r in remainders:
            set_side_table(r, entries)
        return
    for r, table in zip(remainders, entries.split(sizes.tolist())):
        set_side_table(r, table.clone() if table.numel() else table)


def adamw_8bit_steps_(steps: list, hyper: Hyper, seed: int, step: int) -> int:
    """`fused_adamw_8bit.step_` of each ``(w, grad, mq, ms, vq, vs, count, cap, tensor, first,
    backup)`` of ``steps`` (CPU tensors; ``count``: the step count, as `adamw_steps_`'s) in turn,
    as the op: how many wrote before the first that would write a non-finite weight."""
    if not steps:
        return 0
    w, grad, mq, ms, vq, vs, count, cap, tensor, first, backup = (list(column) for column in zip(*steps))
    return int(_run("adamw_8bit", w, grad, mq, ms, vq, vs, [t for b in backup for t in b], count,
                    *_values(hyper), cap, seed, step, tensor, first))


def sgd_steps_(steps: list, hyper: fused_sgd.Hyper, seed: int, step: int) -> None:
    """`fused_sgd.step_` of each ``(w, grad, buf, new, tensor, index)`` of ``steps`` (CPU tensors
    of one group; ``buf`` None for all or none): the declared op, once, for those whose ``index``
    is an int (the C kernel's case), the eager reference for the others."""
    runs, others = _kernel_runs(steps, 5)
    for w, grad, buf, new, tensor, index in others:
        fused_sgd.step_(w, grad, buf, hyper, new, seed, step, tensor, index)
    if runs:
        w, grad, buf, new, tensor, first = (list(column) for column in zip(*runs))
        _run("sgd_bf16", w, grad, _all_or_none("buf", buf), *_sgd_values(hyper), new, seed, step, tensor, first)


def sgd_master_steps_(steps: list, hyper: fused_sgd.Hyper) -> None:
    """`fused_sgd.step_master_` of each ``(x, grad, buf, new, w)`` of ``steps`` (CPU tensors of one
    group; ``buf`` None for all or none; ``w`` as `master_steps_`'s), as the op."""
    if steps:
        x, grad, buf, new, w = (list(column) for column in zip(*steps))
        _run("sgd_master", x, grad, _all_or_none("buf", buf), _weights(w), *_sgd_values(hyper), new)


def sgd_remainder_steps_(steps: list, hyper: fused_sgd.Hyper) -> None:
    """`fused_sgd_remainder.step_` of each ``(w, r, grad, buf, new)`` of ``steps`` (CPU tensors of
    one group; ``buf`` None for all or none), as the op."""
    if steps:
        w, r, grad, buf, new = (list(column) for column in zip(*steps))
        _set_tables(r, _run("sgd_remainder", w, r, grad, _all_or_none("buf", buf), [_table_arg(x) for x in r],
                            *_sgd_values(hyper), new))


def sgd_8bit_steps_(steps: list, hyper: fused_sgd.Hyper, seed: int, step: int) -> int:
    """`fused_sgd_8bit.step_` of each ``(w, grad, bq, bs, new, tensor, first, backup)`` of ``steps``
    (CPU tensors of one group) in turn, as the op: how many wrote before the first that would
    write a non-finite weight."""
    if not steps:
        return 0
    w, grad, bq, bs, new, tensor, first, backup = (list(column) for column in zip(*steps))
    return int(_run("sgd_8bit", w, grad, bq, bs, [t for b in backup for t in b], *_sgd_values(hyper), new,
                    seed, step, tensor, first))
