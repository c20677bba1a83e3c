"""O8's blocks laid on the full parameter: which blocks FSDP2's shards split, and shards that
share those blocks' maxima pack the state as the whole parameter does (ranks simulated by
threads here; tests/parallel/test_fsdp_world_size.py runs real ones)."""
import itertools
import threading
from types import SimpleNamespace

import pytest
import torch

from ampkit._update import shared_blocks, state_8bit


def _placements(*names):
    from torch.distributed.tensor import Replicate, Shard

    return tuple({"R": Replicate(), "S0": Shard(0), "S1": Shard(1)}[n] for n in names)


@pytest.mark.parametrize("shape, mesh, placements, runs, split", [
    ((5, 300), (2,), ("S0",), ((0, 900), (900, 600)), (3,)),
    ((5, 300), (4,), ("S0",), ((0, 600), (600, 600), (1200, 300), (1500, 0)), (2, 4)),
    ((7, 5), (3,), ("S0",), ((0, 15), (15, 15), (30, 5)), (0,)),
    ((4, 256), (2,), ("S0",), ((0, 512), (512, 512)), ()),  # cut on a block boundary
    ((5, 300), (2, 2), ("R", "S0"), ((0, 900), (900, 600)), (3,)),  # HSDP: along the shard dimension
    ((1000,), (1,), ("S0",), ((0, 1000),), ()),
])
def test_fsdp2_layouts_and_their_split_blocks(shape, mesh, placements, runs, split):
    dim, got = shared_blocks._runs(shape, mesh, _placements(*placements))
    assert dim == len(mesh) - 1 and got == runs
    assert shared_blocks._split(got, 256) == split


@pytest.mark.parametrize("shape, mesh, placements", [((6, 10), (2,), ("S1",)), ((8, 4), (2, 2), ("S0", "S0"))])
def test_other_layouts_keep_blocks_of_their_own(shape, mesh, placements):
    """Parts that are not one run of the flat tensor, or sharded along two mesh dimensions."""
    assert shared_blocks._runs(shape, mesh, _placements(*placements)) is None


def test_plain_tensors_are_their_own_full_tensor():
    t = torch.zeros(1000)
    assert shared_blocks.block_first(t) == 0 and shared_blocks.split_blocks(t, 256) == ()
    assert shared_blocks.whole_blocks(t, 256)


class _Part:
    """What ``shared_blocks`` reads of one rank's DTensor parameter: its full shape, placements,
    mesh shape and this rank's coordinate (the parts' offsets are torch's own)."""

    def __init__(self, shape, mesh, placements, coordinate):
        self.shape, self.placements = torch.Size(shape), _placements(*placements)
        self.device_mesh = SimpleNamespace(shape=tuple(mesh), get_coordinate=lambda: list(coordinate))

    def to_local(self):
        raise AssertionError("not read")


@pytest.mark.parametrize("shape, mesh, placements, whole", [
    ((1024, 3), (4,), ("S0",), True),  # 256 rows of 3 each: 768 elements apart
    ((1000, 3), (4,), ("S0",), False),  # 250 rows: 750 apart
    ((512,), (2,), ("S0",), True), ((513,), (2,), ("S0",), False), ((513,), (1,), ("S0",), True),
    ((64, 8), (2,), ("S0",), True), ((3, 256), (2,), ("S0",), True), ((3, 100), (2,), ("S0",), False),
    ((5, 256), (2,), ("S0",), True), ((10, 128), (4,), ("S0",), False),  # rows not divisible: 3, 3, 3, 1 rows
    ((6, 128), (4,), ("S0",), True), ((3, 256), (4,), ("S0",), True),  # the last shard empty
    ((1, 300), (2,), ("S0",), True),  # all on rank 0, rank 1's part empty: no block to share
    ((5, 300), (4,), ("S0",), False),  # 600 apart, the last part empty
    ((4, 256), (2, 2), ("R", "S0"), True), ((1024, 3), (2, 2), ("R", "S0"), True),  # HSDP 2 x 2
    ((5, 300), (2, 2), ("R", "S0"), False), ((1000, 3), (2, 2), ("R", "S0"), False),
    ((6, 10), (2,), ("S1",), False), ((8, 4), (2, 2), ("S0", "S0"), False),  # not laid on the full tensor
])
def test_whole_blocks_reads_every_ranks_part_and_answers_alike_on_each(shape, mesh, placements, whole):
    """O8's fused kernel takes a DTensor whose parts split no block of the full tensor (so its
    per-part block maxima are the full tensor's): then each non-empty part starts on a block
    boundary. Every rank of the mesh answers the same (the fused / chunk choice is followed
    by collectives), and a replicated tensor of any shape stays off the kernel."""
    answers = []
    for coordinate in itertools.product(*map(range, mesh)):
        part = _Part(shape, mesh, placements, coordinate)
        answers.append(shared_blocks.whole_blocks(part, 256))
        if answers[-1]:
            first, numel, _ = shared_blocks._plan(part)
            assert numel == 0 or first % 256 == 0
        assert not shared_blocks.whole_blocks(_Part(shape, mesh, ("R",) * len(mesh), coordinate), 256)
    assert answers == [whole] * len(answers)


class _Counter:
    seed, step = 5, 3


class _Ranks:
    """``all_reduce(MAX)`` across threads, one call at a time: each thread's tensor becomes
    the maximum of all the threads' tensors."""

    def __init__(self, n):
        self.barrier, self.parts, self.calls = threading.Barrier(n, timeout=60), {}, 0

    def all_reduce(self, t, op=None, group=None):
        assert group is self and op == torch.distributed.ReduceOp.MAX
        self.parts[threading.get_ident()] = t.clone()
        self.barrier.wait()
        total = torch.stack(list(self.parts.values())).amax(0)
        self.barrier.wait()
        t.copy_(total)
        if self.barrier.wait() == 0:
            self.calls += 1


@pytest.mark.parametrize("cuts", [[0, 1000], [0, 900, 1000], [0, 300, 400, 1000], [0, 256, 600, 1000], [0, 1000, 1000]])
def test_shards_cut_anywhere_pack_as_the_whole_parameter(monkeypatch, cuts):
    """A parameter's state packed whole equals its pieces (FSDP2's shards, simulated: each
    piece's blocks start at its offset in the full parameter, each packs in its own thread,
    and split blocks share their maxima) packed at once, codes bit for bit and each block's
    scale on every piece that holds a part of it; one collective per code, none without a
    split block. Without the sharing, a cut inside a block changes the codes."""
    g = torch.Generator().manual_seed(2)
    n = cuts[-1]
    m, v = torch.randn(n, generator=g) * 1e-3, torch.rand(n, generator=g) * 1e-6
    m[[899, 901]] = torch.tensor([1.0, -3e-3])  # a large value on one side of a cut
    runs = tuple((a, b - a) for a, b in zip(cuts, cuts[1:]))
    pieces = [({"exp_avg": m[a:b].clone(), "exp_avg_sq": v[a:b].clone()}, torch.zeros(b - a)) for a, b in zip(cuts, cuts[1:])]
    ranks, share = _Ranks(len(pieces)), True
    plans = {id(p): (a, p.numel(), runs) for (_, p), a in zip(pieces, cuts)}
    monkeypatch.setattr(shared_blocks, "_plan", lambda t: plans.get(id(t)))
    monkeypatch.setattr(shared_blocks, "_group", lambda t: ranks)
    monkeypatch.setattr(torch.distributed, "all_reduce", ranks.all_reduce)
    monkeypatch.setattr(torch.distributed, "get_backend_config", lambda group=None: "cpu:gloo")  # the threads' group
    monkeypatch.setattr(state_8bit, "global_index", lambda p: plans[id(p)][0] if id(p) in plans else 0)
    real = state_8bit._shared_absmax
    monkeypatch.setattr(state_8bit, "_shared_absmax", lambda *a: real(*a) if share else None)

    def pack_on_threads():
        states = [({k: t.clone() for k, t in st.items()}, p) for st, p in pieces]
        errors = []

        def one(state):
            try:
                state_8bit.pack([state], {}, None, _Counter, {state[1]: 4})
            except BaseException as e:  # reported below
                errors.append(e)
        threads = [threading.Thread(target=one, args=(s,)) for s in states]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        return [st for st, _ in states]

    whole_p = torch.zeros(n)
    whole = {"exp_avg": m.clone(), "exp_avg_sq": v.clone()}
    state_8bit.pack([(whole, whole_p)], {}, None, _Counter, {whole_p: 4})
    split = pack_on_threads()
    assert ranks.calls == (2 if shared_blocks._split(runs, 256) else 0)
    for key in ("exp_avg", "exp_avg_sq"):
        codes = torch.cat([st[key + state_8bit.CODES] for st in split])
        assert codes.dtype == whole[key + state_8bit.CODES].dtype and torch.equal(codes, whole[key + state_8bit.CODES])
        for st, (a, size) in zip(split, runs):
            blocks = slice(a // 256, (a + size - 1) // 256 + 1) if size else slice(0, 0)
            assert torch.equal(st[key + state_8bit.SCALES], whole[key + state_8bit.SCALES][blocks]), (key, a)
    if 900 in cuts:
        share = False
        alone = pack_on_threads()
        assert not torch.equal(torch.cat([st["exp_avg.codes"] for st in alone]), whole["exp_avg.codes"])
