"""Device row helpers of the transfer module."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hongtu.engine.pinned import slab_copies
from hongtu.engine.transfer import (
    BLOCK_LAYOUT,
    HOLD_BATCHES,
    Mover,
    _block_runs,
    add_rows,
    block_copy_bytes,
    pin_blocks,
)
from hongtu.nn.block import Block


@pytest.mark.gpu
@pytest.mark.parametrize("width", [1, 37, 256, 600])
def test_add_rows_matches_index_add(width):
    """The atomics-free row add equals index_add_ with unique ids, bit for bit."""
    dst = torch.randn(5000, width, device="cuda")
    ids = torch.randperm(5000, device="cuda")[:3001]
    src = torch.randn(3001, width, device="cuda")
    ref = dst.clone().index_add_(0, ids, src)
    add_rows(dst, ids, src)
    assert torch.equal(dst, ref)


def test_add_rows_on_cpu():
    dst = torch.zeros(6, 3)
    add_rows(dst, torch.tensor([4, 1]), torch.ones(2, 3))
    assert dst.sum(1).tolist() == [0, 3, 0, 0, 3, 0]


@pytest.mark.gpu
def test_timeline_marks_every_layer_pass(tmp_path):
    """The opt-in timeline (bench/bench_passes.py) holds every timed piece of one epoch
    and a mark and byte counters at each layer pass; it does not change the totals."""
    from hongtu.config import config_from_dict
    from hongtu.engine.trainer import Trainer

    cfg = config_from_dict({
        "data": {"path": "builtin:sbm-small"}, "model": {"hidden": 16, "layers": 2},
        "engine": {"chunks": 4, "resident": False, "cache_dir": str(tmp_path / "cache")},
        "output": {"dir": str(tmp_path / "run")}})
    tr = Trainer(cfg, out=lambda s: None)
    mv = tr.executor.mover
    mv.timeline = []
    rec = tr.run_epoch(0, evaluate=False)
    assert len([t for t in mv.timeline if t[0] == "pass"]) == 4 == len(mv.pass_bytes)
    assert mv.pass_bytes[0] == (0, 0) and all(b >= a >= 0 for _, a, b in mv.timeline)
    h2d = sum(b - a for f, a, b in mv.timeline if f == "time_h2d_s") / 1e3
    assert h2d == pytest.approx(rec["time_h2d_s"], rel=1e-3)


def test_pin_blocks_in_place_replaces_each_block():
    """With ``in_place`` the caller's list holds the copies (``None`` kept), equal
    to the blocks they replace; without, the list is left as it was."""
    blocks = _blocks()
    before = list(blocks)
    copies = pin_blocks(blocks, copies=_slab)
    assert all(a is b for a, b in zip(blocks, before)) and copies is not blocks
    out = pin_blocks(blocks, copies=_slab, in_place=True)
    assert out is blocks and blocks[-1] is None
    for b, p in zip(before[:-1], blocks[:-1]):
        assert p is not b and p.indices.dtype == torch.int32
        for name in b.tensor_names():
            assert torch.equal(getattr(p, name).to(getattr(b, name).dtype), getattr(b, name))


def _blocks():
    """Three chunks' blocks of a random graph and one missing (``None``)."""
    from hongtu.nn.block import build_block

    rng = np.random.default_rng(3)
    n = 40
    deg = rng.integers(0, 6, n)
    indptr = np.concatenate([[0], np.cumsum(deg)]).astype(np.int64)
    indices = rng.integers(0, n, int(indptr[-1])).astype(np.int64)
    d = np.diff(indptr).astype(np.float64)
    return [build_block(indptr, indices, d, a, b) for a, b in ((0, 13), (13, 30), (30, n))] + [None]


def _slab(tensors):
    return slab_copies(tensors, lambda nbytes: (torch.zeros(nbytes, dtype=torch.uint8), True))


def test_pinned_blocks_put_each_pass_arrays_side_by_side():
    """pin_blocks lays each block out so that the arrays a pass copies are one
    run per dtype (forward without the transpose, a cached layer's backward,
    all), with every array's place in its span."""
    blocks = _blocks()
    pinned = pin_blocks(blocks, copies=_slab)
    assert pinned[-1] is None
    for b, p in zip(blocks[:-1], pinned[:-1]):
        for name in b.tensor_names():
            assert torch.equal(getattr(p, name).long() if name in BLOCK_LAYOUT[:6]
                               else getattr(p, name), getattr(b, name))
        assert p.indices.dtype == p.t_perm.dtype == torch.int32
        for skip, ints in ((Block.TRANSPOSE, ("indices", "indptr", "src_ids")),
                           (Block.NOT_TRANSPOSED, ("indptr", "src_ids", "t_indptr", "t_indices")),
                           ((), BLOCK_LAYOUT[:6])):
            runs = _block_runs(p, skip)
            assert [tuple(n for n, _, _ in parts) for _, parts in runs] == \
                [ints, ("src_in_deg", "dst_in_deg")]
            for span, parts in runs:
                for name, a, b_ in parts:
                    assert torch.equal(span[a:b_], getattr(p, name))
    # Arrays that do not lie side by side travel one by one.
    runs = _block_runs(blocks[0], Block.TRANSPOSE)
    assert sorted(n for _, parts in runs for n, a, _ in parts if a is None) == \
        sorted(n for n in blocks[0].tensor_names() if n not in Block.TRANSPOSE)


@pytest.mark.parametrize("case", ["skewed", "isolated"])
def test_block_copy_bytes_are_what_fetch_block_moves(case):
    """The bytes ``hongtu report`` counts for a chunk's block from its sizes alone
    equal what the executor's pinned layout copies for every pass's arrays,
    with chunks' sizes as the planner counts them (one chunk without edges)."""
    from hongtu.engine.budget import chunk_sizes
    from hongtu.engine.chunks import ChunkSet
    from tests.cases import CASES

    graph = CASES[case](seed=0)
    n = graph.num_nodes
    no_edges = np.flatnonzero(np.diff(graph.indptr) == 0)
    ptr = np.unique(np.concatenate([[0, n], np.linspace(0, n, 6).astype(np.int64),
                                    no_edges[:1], no_edges[:1] + 1]))
    blocks = ChunkSet.build(graph, ptr, 1, len(ptr) - 1).blocks
    sizes = chunk_sizes(graph, np.arange(n), ptr)
    assert any(b.num_edges == 0 for b in blocks) == (case == "isolated")
    pinned = pin_blocks(blocks, copies=_slab)
    for c, (b, p) in enumerate(zip(blocks, pinned)):
        assert (b.num_src, b.num_dst, b.num_edges) == (
            sizes.num_src[c], sizes.num_dst[c], sizes.num_edges[c])
        for skip in ((), Block.TRANSPOSE, Block.NOT_TRANSPOSED, ("indices",), ("t_indptr",)):
            moved = sum(span.nbytes for span, _ in _block_runs(p, skip))
            assert block_copy_bytes(b.num_src, b.num_dst, b.num_edges, skip, n,
                                    p.src_in_deg.element_size()) == moved, (c, skip)


@pytest.mark.gpu
@pytest.mark.parametrize("overlap", [True, False])
def test_fetch_block_brings_the_arrays_widened(overlap):
    d = torch.device("cuda")
    mv = Mover(d, {"dst": (1, 1)}, 1, torch.float32, overlap=overlap)
    for b, p in zip(_blocks()[:-1], pin_blocks(_blocks())[:-1]):
        for skip in (Block.TRANSPOSE, Block.NOT_TRANSPOSED, ()):
            before = mv.traffic.h2d_bytes
            got = mv.take_block(mv.fetch_block(p, skip))
            assert mv.traffic.h2d_bytes - before == mv.block_bytes(p, skip) >= p.nbytes(skip)
            for name in b.tensor_names():
                t = getattr(got, name)
                if name in skip:
                    assert t.device.type == "cpu"
                else:
                    assert t.is_cuda and t.dtype == getattr(b, name).dtype
                    assert torch.equal(t.cpu(), getattr(b, name))


@pytest.mark.gpu
def test_fold_reads_finished_work_early_and_the_rest_at_settle():
    """Times of work the device has finished are read while it goes on; settle
    reads the rest; together they are every timed piece once."""
    d = torch.device("cuda")
    mv = Mover(d, {"dst": (1, 1)}, 1, torch.float32)
    x = torch.randn(2048, 2048, device=d)
    for _ in range(6):
        with mv.timing("time_compute_s"):
            x = torch.tanh(x @ x)
    events = list(mv._events)
    mv.compute.synchronize()
    with mv.timing("time_compute_s"):
        x = torch.tanh(x @ x)
    mv.fold(done_only=True)
    assert len(mv._events) <= 1 and mv.traffic.time_compute_s > 0  # (the last may be done)
    events += mv._events
    mv.settle()
    assert not mv._events
    want = sum(a.elapsed_time(b) for _, a, b in events) / 1000.0
    assert mv.traffic.time_compute_s == pytest.approx(want, rel=1e-9)


@pytest.mark.gpu
def test_streams_switch_back_and_waits_hold_with_one_event_per_stream():
    """``_on`` selects a stream and restores the one before it, nested too; a
    wait between streams (one event per stream, recorded again each time)
    holds the work issued before it; timing events read by ``fold`` are
    recorded again, not made anew."""
    d = torch.device("cuda")
    mv = Mover(d, {"dst": (1, 1)}, 1, torch.float32)
    assert torch.cuda.current_stream() == mv.compute
    with mv._on(mv.s_in):
        assert torch.cuda.current_stream() == mv.s_in
        with mv._on(mv.s_out, after_compute=False):
            assert torch.cuda.current_stream() == mv.s_out
        assert torch.cuda.current_stream() == mv.s_in
    assert torch.cuda.current_stream() == mv.compute
    x = torch.zeros(1 << 20, device=d)
    for k in range(1, 4):  # the load stream reads what compute wrote after a long kernel
        torch.cuda._sleep(50_000_000)
        x.fill_(k)
        with mv._on(mv.s_in):
            seen = x.sum()
        mv.s_in.synchronize()
        assert seen.item() == k * x.numel()
    for k in range(1, 4):  # and compute, after join, what the store stream wrote
        with mv._on(mv.s_out):
            torch.cuda._sleep(50_000_000)
            x.fill_(-k)
        mv.join()
        assert x.sum().item() == -k * x.numel()
    with mv.timing("time_compute_s"):
        x.add_(1)
    mv.settle()
    spare = {id(e) for e in mv._spare}
    assert len(spare) == 2
    before = mv.traffic.time_compute_s
    with mv.timing("time_compute_s"):
        torch.cuda._sleep(10_000_000)
    mv.settle()
    assert {id(e) for e in mv._spare} == spare and mv.traffic.time_compute_s > before


@pytest.mark.gpu
def test_a_pass_may_end_before_its_stores_and_loads_after_it_see_them():
    """``join(stores=False)``: compute goes on while the store stream still
    works (a slow one here); the next pass's loads of ranges (after
    ``barrier``) wait for those stores and read what they wrote; with
    ``stores`` compute waits for them. ``stored_in_pass`` says whether the pass
    issued any."""
    d = torch.device("cuda")
    n = 1 << 16
    mv = Mover(d, {"aux": (n, 4)}, 4, torch.float32)
    host = torch.zeros(n, 4).pin_memory()
    for k, stores in ((1, False), (2, False), (3, True)):
        mv.barrier()
        assert not mv.stored_in_pass
        with mv._on(mv.s_out, after_compute=False):
            torch.cuda._sleep(200_000_000)  # (a store stream far behind)
        mv.store_range(host, 0, torch.full((n, 4), float(k), device=d))
        stored = torch.cuda.Event()
        stored.record(mv.s_out)
        assert mv.stored_in_pass
        mv.join(stores=stores)
        computed = torch.cuda.Event()
        computed.record(mv.compute)
        computed.synchronize()
        assert stored.query() == stores  # (compute waited for the stores, or not)
        mv.barrier()
        got = mv.take(mv.fetch_range(host, 0, n, "aux"))
        assert bool((got == k).all())  # (the load saw them)
        mv.settle()


@pytest.mark.gpu
def test_a_stores_source_is_given_back_after_compute_waits_for_the_store():
    """The tensor a store reads stays allocated when the caller drops it, and
    is given back when the batch ``HOLD_BATCHES`` after its own begins
    (``step``), after compute waits for the store on the device: what compute
    allocates next in its place (the same memory) is written only once the
    store, held up behind a slow store stream here, has read it. ``join``
    with stores gives back the rest at once."""
    d = torch.device("cuda")
    n = 1 << 18  # (4 MiB of rows: its own piece of the allocator's cache)
    mv = Mover(d, {"dst": (1, 1)}, 4, torch.float32)
    host = torch.zeros(n, 4).pin_memory()
    mv.step()
    value = torch.full((n, 4), 3.0, device=d)
    ptr, base = value.data_ptr(), torch.cuda.memory_allocated()
    with mv._on(mv.s_out, after_compute=False):
        torch.cuda._sleep(200_000_000)  # (a store stream far behind)
    mv.store_range(host, 0, value)
    del value
    for _ in range(HOLD_BATCHES - 1):
        mv.step()
        assert torch.cuda.memory_allocated() == base  # (held: the store reads it)
    mv.step()
    assert torch.cuda.memory_allocated() < base  # (given back)
    again = torch.empty((n, 4), device=d)
    assert again.data_ptr() == ptr  # (compute reuses that memory...)
    again.fill_(-1.0)  # (...only after the store read it)
    torch.cuda.synchronize()
    assert bool((host == 3.0).all())
    for k in range(3):  # stores of one batch; join with stores gives them back
        mv.store_range(host, 0, torch.full((n, 4), float(k), device=d))
    held = torch.cuda.memory_allocated()
    mv.join(stores=False)
    assert torch.cuda.memory_allocated() == held
    mv.join()
    assert torch.cuda.memory_allocated() == held - 3 * n * 4 * 4
    mv.settle()


@pytest.mark.gpu
def test_a_blocks_copy_waits_for_compute_that_read_its_memory_before():
    """A block's device memory is compute's (``fetch_block``): memory compute
    freed, a slow kernel still reading it, may hold the block, whose copy waits
    for that kernel; the kernel reads what it should."""
    d = torch.device("cuda")
    mv = Mover(d, {"dst": (1, 1)}, 1, torch.float32)
    p = pin_blocks(_blocks())[1]
    span = mv._block_copies(p, ())[0][0][0]
    old = torch.full(span.shape, -7, dtype=span.dtype, device=d)
    ptr = old.data_ptr()
    torch.cuda._sleep(200_000_000)  # (compute far behind)
    read = old.clone()
    del old
    t = mv.fetch_block(p, ())
    assert t.keep and t.keep[0].data_ptr() == ptr  # (its first copy, int32, went there)
    got = mv.take_block(t)
    torch.cuda.synchronize()
    assert bool((read == -7).all())
    for name in p.tensor_names():
        assert torch.equal(getattr(got, name).cpu(), getattr(_blocks()[1], name))
    mv.settle()


def numbered_rows(d: torch.device) -> torch.Tensor:
    """40 host rows of 3 numbered 0..119 (pinned for a GPU)."""
    host = torch.arange(40 * 3, dtype=torch.float32).view(40, 3)
    return host.pin_memory() if d.type == "cuda" else host


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("overlap", [True, False])
def test_fetch_ahead_lands_pieces_in_order(device, overlap):
    """``fetch_ahead``: rows ``start..stop-1`` into rows ``at..`` of a wider
    buffer's first columns, a piece at a time, each counted once; the last
    piece's ticket is ready once every piece has landed (one stream), while
    compute goes on reading the rest of the buffer."""
    d = torch.device(device)
    host = numbered_rows(d)
    mv = Mover(d, {"dst": (1, 1)}, 5, torch.float32, overlap=overlap)
    buf = torch.full((30, 5), -1.0, device=d)
    before = mv.traffic.h2d_rows
    tickets = [mv.fetch_ahead(host, 6 + a, 6 + b, buf, a, a == 0)
               for a, b in ((0, 7), (7, 7), (7, 20))]
    assert mv.fetch_ahead(host, 3, 3, buf, 0, False).ready is None  # (nothing to move)
    buf[25:] = 7.0  # (compute meanwhile, elsewhere in the buffer)
    mv.place(tickets[-1])
    want = torch.full((30, 5), -1.0)
    want[:20, :3], want[25:] = host[6:26], 7.0
    assert torch.equal(buf.cpu(), want)
    assert mv.traffic.h2d_rows - before == 20
    mv.settle()


@pytest.mark.gpu
def test_settle_waits_for_rows_fetched_ahead():
    """An epoch ends (``settle``) while the next forward's first rows, fetched
    ahead, still travel on the gather's stream, which compute does not wait
    for: settle waits for them before it reads their times (it stopped in
    ``elapsed_time`` on reddit-like GCN 2x256), and they stay fetched."""
    d = torch.device("cuda")
    rows = 1 << 17
    host = torch.arange(rows, dtype=torch.float32).view(-1, 1).expand(rows, 1024)
    host = host.contiguous().pin_memory()  # 512 MiB: about 10 ms over the link
    buf = torch.zeros(rows, 1024, device=d)
    mv = Mover(d, {"dst": (1, 1)}, 1024, torch.float32)
    ticket = mv.fetch_ahead(host, 0, rows, buf, 0, True)
    mv.settle()
    assert not mv._events and mv.traffic.time_h2d_s > 0
    assert ticket.ready.query()
    mv.place(ticket)
    assert torch.equal(buf[:, 0].cpu(), host[:, 0]) and torch.equal(buf[-1].cpu(), host[-1])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("overlap", [True, False])
def test_gather_rows_brings_a_run_then_the_gathered_rows(device, overlap):
    """``gather_rows(run=(a, b))``: rows ``a..b-1`` (one copy) and then the
    gathered ones, positions translated through ``at`` where given, each row
    counted once; a run alone or rows alone too."""
    d = torch.device(device)
    host = numbered_rows(d)
    mv = Mover(d, {"dst": (1, 1)}, 3, torch.float32, overlap=overlap)
    out = torch.full((12, 3), -1.0, device=d)
    ids = torch.tensor([30, 2, 17], device=d)
    for run, at in (((5, 9), None), ((0, 0), None), ((7, 16), None), ((5, 9), "flip")):
        pos = torch.arange(39, -1, -1, device=d, dtype=torch.int32) if at else None
        rows = ids[:0] if run == (7, 16) else ids
        before = mv.traffic.h2d_rows
        got = mv.take(mv.gather_rows(host, rows, out, at=pos, run=run))
        where = rows.cpu() if pos is None else pos.cpu().long()[rows.cpu()]
        want = torch.cat([host[run[0]:run[1]], host[where]])
        assert torch.equal(got.cpu(), want)
        assert mv.traffic.h2d_rows - before == want.shape[0]
