"""Ring attention (context parallelism): the ring schedule (benchmarks/NOTES.md, "Ring attention").

Each of W ranks holds a shard of the queries, keys and values (:mod:`cuattn.dist.layout`).
At step s rank r computes its queries against the K/V shard of rank r - s, which it received
from rank r - 1 while it computed step s - 1, and folds the result into an fp32 accumulator
with the forward kernels' accumulating form (forward/accumulate.cuh): each output row is
rounded once, by the launch of its last piece or, when that launch also covers rows with
pieces still to come, from the accumulator after the last step. A step's pieces are as few
launches as the masks allow (cuattn/dist/pieces.py). Only the KV heads travel.

The backward passes K/V around the ring again with each shard's dK / dV accumulators (fp32):
rank r adds its queries' contribution to the shard it holds, computed from its global ``out``
and ``lse``, then sends the accumulators on; after W steps they are back with their owner.
dQ is summed in fp32 on its rank: the backward kernels add every piece of dQ, dK and dV into
those fp32 sums (BackwardParams::sum_grads), and each gradient is rounded once, at the end.

A rank's work is a generator of exchanges: it yields ``("send", channel, send_arrays,
recv_arrays)`` and ``("wait", channel)``, and a driver carries them out. The driver here runs
every rank in one process on one GPU (:func:`ring_attention_simulated`), each exchange a set
of device copies on a separate stream; :func:`ring_attention` runs one rank per process with
the same generators, its exchanges over a ``torch.distributed`` process group
(cuattn/dist/process_group.py).
"""

from __future__ import annotations

import numpy as np

from cuattn import boundary, validation
from cuattn.attention import _LAYOUT, attn_params, check_qkv, launch_forward
from cuattn.backward import SUM_DKDV, SUM_DQ, backward_params, check_dout, launch_backward, plan_backward, tma_splits
from cuattn.chunked import check_row_stats
from cuattn.dist import layout as layouts
from cuattn.dist import process_group
from cuattn.dist.pieces import Plan, covered_runs, plan
from cuattn.kernels.backward import DQ_TILE_ROWS, BackwardGrid
from cuattn.merge import sum_rows
from cuattn.options import AttnOptions
from cuattn.validation import check_bool


def _rows(a: boundary.DeviceArray, run) -> boundary.DeviceArray:
    """Rows of a run or span (``local_start``, ``length``) of a (batch, seqlen, heads, head_dim) array."""
    return a.span(1, run.local_start, run.local_start + run.length)


def _stat_rows(a: boundary.DeviceArray, run) -> boundary.DeviceArray:
    """Rows of a run or span of a (batch, heads, seqlen) statistic."""
    return a.span(2, run.local_start, run.local_start + run.length)


def _mask(options: AttnOptions) -> tuple[int, int]:
    """The position window of the options, causal folded in (right <= 0)."""
    right = options.window_right
    if options.causal:
        right = 0 if right < 0 else min(right, 0)
    return options.window_left, right


def _send_kv(ctx, held):
    """Posts the K/V shard held to the next rank; returns the buffers the previous rank's arrives in."""
    arriving = tuple(ctx.empty(x.shape, x.dtype) for x in held)
    yield ("send", "kv", held, arriving)
    return arriving


def forward_steps(ctx, c_type: str, q, k, v, out, lse, options: AttnOptions, work: Plan):
    """One rank's forward: writes ``out`` and ``lse``, yielding its exchanges."""
    acc = ctx.empty(q.shape, np.float32)
    starts = [[r.local_start for r in covered_runs(work.runs, qs)] for pieces in work.steps for qs, _, _ in pieces]
    last = {start: i for i, runs in enumerate(starts) for start in runs}
    if set(last) != {r.local_start for r in work.runs}:  # a query sees its own position, whatever the mask
        raise AssertionError("a run of queries sees no key")
    # A piece rounds its rows into out when it is the last of every run it covers; runs whose
    # last piece also covers a run with more to come are rounded from acc at the end.
    rounded = {start for i, runs in enumerate(starts) if all(last[r] == i for r in runs) for start in runs}
    started, i, cur = set(), 0, (k, v)
    for s, pieces in enumerate(work.steps):
        more = s < len(work.steps) - 1
        if more:
            nxt = yield from _send_kv(ctx, cur)
        for qs, ks, fields in pieces:
            fresh = {start not in started for start in starts[i]}
            if len(fresh) != 1:
                raise AssertionError("a piece folds into rows both fresh and started")
            dst = _rows(out, qs) if all(last[r] == i for r in starts[i]) else out.unwritten()
            p = attn_params(_rows(q, qs), _rows(cur[0], ks), _rows(cur[1], ks), dst, _stat_rows(lse, qs), options)
            for name, value in fields.items():
                p[name] = value
            p["accum"], p["accum_strides"], p["accum_fresh"] = _rows(acc, qs).ptr, acc.strides[:3], int(fresh.pop())
            started.update(starts[i])
            launch_forward(ctx, c_type, p, qs.length, q.shape[2], q.shape[0])
            i += 1
        if more:
            yield ("wait", "kv")
            cur = nxt
    for run in work.runs:
        if run.local_start not in rounded:
            sum_rows(ctx, None, _rows(acc, run), _rows(out, run))


def backward_steps(ctx, c_type: str, a: dict, grads: tuple, options: AttnOptions, work: Plan, deterministic: bool):
    """One rank's backward: writes ``grads`` (dq, dk, dv), yielding its exchanges. ``a``: the
    rank's dout, q, k, v, out, lse, dlse.

    At step s > 0 the kernels add this rank's dK / dV for the shard it holds into a zeroed
    scratch pair while that shard's accumulators are still on their way from the previous
    rank; the scratch is then added into them and they travel on. Both exchanges overlap the
    kernels. The last holder of a shard rounds its sums to the input dtype and sends them to
    the owner as its dK / dV: the one hop that follows the last kernels carries half the bytes.

    The first K/V exchange is posted before the prep and zeroing: NCCL's kernel is then ready
    while those small kernels run. Posted after them it became ready at the same moment as the
    first backward kernel, whose CTAs can take every SM; when they did, the transfer waited for
    that kernel's whole run while the peer's NCCL kernel spun on its SMs (2 x H200, 8k tokens
    per rank: one rank's first backward kernel 13% slower)."""
    q, k, v = a["q"], a["k"], a["v"]
    batch, _, heads_q, head_dim = q.shape
    cur = (k, v)
    if len(work.steps) > 1:  # the first K/V leave before any kernel is queued (docstring)
        nxt = yield from _send_kv(ctx, cur)
    delta = ctx.empty((batch, heads_q, q.shape[1]), np.float32)
    dq_sum = _DqSum(ctx, c_type, a, grads, delta, options, work, deterministic)
    accs = (ctx.empty(k.shape, np.float32), ctx.empty(v.shape, np.float32))
    ctx.zero(*accs)
    scratch = (ctx.empty(k.shape, np.float32), ctx.empty(v.shape, np.float32)) if len(work.steps) > 1 else None
    for s, pairs in enumerate(work.steps):
        more = s < len(work.steps) - 1
        if more and s > 0:  # step 0's went before the prep
            nxt = yield from _send_kv(ctx, cur)
        sums = accs if s == 0 else scratch  # step 0: this rank's own shard, its accumulators here
        if s > 0 and pairs:
            ctx.zero(*scratch)
        for qr, kr, fields in pairs:  # spans of rows
            attn = attn_params(_rows(q, qr), _rows(cur[0], kr), _rows(cur[1], kr), _rows(a["out"], qr), _stat_rows(a["lse"], qr), options)
            for name, value in fields.items():
                attn[name] = value
            rows = {"dout": _rows(a["dout"], qr), "dlse": None if a["dlse"] is None else _stat_rows(a["dlse"], qr)}
            p = backward_params(rows, [dq_sum.rows(qr), _rows(sums[0], kr), _rows(sums[1], kr)], _stat_rows(delta, qr), attn)
            p["sum_grads"] = SUM_DKDV  # the kernels add into the dK / dV sums (dQ: _DqSum)
            grid = BackwardGrid("dense", batch, qr.length, kr.length, heads_q, k.shape[2], head_dim, batch * qr.length, batch * kr.length)
            dq_sum.launch(p, qr, grid)
        added = scratch if s > 0 and pairs else (None, None)  # no pairs: nothing to add
        if s > 0:
            yield ("wait", "acc")  # the accumulators of the shard held, from the previous rank
        if more:
            for piece, total in zip(added, accs) if added[0] is not None else ():
                sum_rows(ctx, piece, total)
            received = (ctx.empty(k.shape, np.float32), ctx.empty(v.shape, np.float32))
            yield ("send", "acc", accs, received)  # the next rank adds its share to them
            accs = received
            yield ("wait", "kv")
            cur = nxt
        else:  # the last holder: the sums are whole; rounded here, they travel home as dK / dV
            rounded = (ctx.empty(k.shape, k.dtype), ctx.empty(v.shape, v.dtype))
            for piece, total, dst in zip(added, accs, rounded):
                sum_rows(ctx, piece, total, dst)
            yield ("send", "acc", rounded, grads[1:])
    dq_sum.finish()
    yield ("wait", "acc")  # this rank's dK / dV, from the last rank that held its shard


class _DqSum:
    """Where a rank's backward pieces add dQ. When every piece's query rows start (and end,
    but for the last) on a 64-row tile and the fused kernel runs: its fp32 accumulator, shared
    by all pieces, with one prep over all rows (delta, and the accumulator's zeros) and one
    finishing pass into dq. Otherwise an fp32 sum the pieces' own launches add into
    (BackwardParams::sum_grads), rounded into dq at the end."""

    def __init__(self, ctx, c_type: str, a: dict, grads: tuple, delta, options: AttnOptions, work: Plan, deterministic: bool):
        self.ctx, self.c_type, self.deterministic, self.dq = ctx, c_type, deterministic, grads[0]
        q, k = a["q"], a["k"]
        batch, local, heads_q, head_dim = q.shape
        spans = [qs for pieces in work.steps for qs, _, _ in pieces]
        aligned = all(s.local_start % DQ_TILE_ROWS == 0 and ((s.local_start + s.length) % DQ_TILE_ROWS == 0 or s.local_start + s.length == local)
                      for s in spans)
        self.whole = None
        if aligned:
            attn = attn_params(q, k, a["v"], a["out"], a["lse"], options)
            p = backward_params({"dout": a["dout"], "dlse": a["dlse"]}, list(grads), delta, attn)
            g = BackwardGrid("dense", batch, local, local, heads_q, k.shape[2], head_dim, batch * local, batch * local)
            self.accumulator = []  # held until the finishing pass is queued
            if plan_backward(ctx, c_type, p, g, deterministic, keep=self.accumulator):
                self.whole = (p, g)
                launch_backward(ctx, c_type, p, g, deterministic, fused=True, stage="prep")
        if self.whole is None:
            self.accumulator = None
            self.total = ctx.empty(q.shape, np.float32)
            ctx.zero(self.total)

    def rows(self, span):
        """dq's view for a piece of rows (the accumulator's kernels do not write it)."""
        return _rows(self.dq if self.whole is not None else self.total, span)

    def launch(self, p, span, grid) -> None:
        if self.whole is None:
            p["sum_grads"] |= SUM_DQ
            launch_backward(self.ctx, self.c_type, p, grid, self.deterministic)
            return
        whole = self.whole[0]
        tile_bytes = (int(whole["dq_accum_cols"]) // 64) * DQ_TILE_ROWS * 64 * 4  # one 64-row block of a head's columns
        p["dq_accum"] = int(whole["dq_accum"]) + span.local_start // DQ_TILE_ROWS * tile_bytes
        p["dq_accum_tile_strides"], p["dq_accum_cols"] = whole["dq_accum_tile_strides"], whole["dq_accum_cols"]
        p["query_splits"] = tma_splits(self.ctx, self.c_type, p, grid)  # the splits add into the dK / dV sums by atomics
        launch_backward(self.ctx, self.c_type, p, grid, self.deterministic, fused=True, stage="main")

    def finish(self) -> None:
        if self.whole is None:
            sum_rows(self.ctx, None, self.total, self.dq)
        else:
            launch_backward(self.ctx, self.c_type, *self.whole, self.deterministic, fused=True, stage="finish")


def _world(q) -> int:
    if not isinstance(q, (list, tuple)) or not q:
        raise TypeError(f"q must be a non-empty list of shards (one per rank), got {type(q).__name__}")
    return len(q)


def _check_shards(shards: dict, world: int) -> None:
    for name, xs in shards.items():
        if not isinstance(xs, (list, tuple)) or len(xs) != world:
            raise ValueError(f"{name} must be a list of {world} shards (one per rank, as q), got {type(xs).__name__}"
                             + (f" of {len(xs)}" if isinstance(xs, (list, tuple)) else ""))
        for r, x in enumerate(xs):
            if x is None:
                raise TypeError(f"{name}[{r}] is required, got None")


def _simulate(ctx, generators) -> None:
    """Runs every rank's generator in lockstep on one device: a send copies rank r's arrays
    into rank r + 1's receive buffers on a copy stream (after what the caller's stream has
    queued); a wait makes the caller's stream wait for that channel's copies."""
    import cupy

    with ctx.device:
        copy = cupy.cuda.Stream(non_blocking=True)
    done = {}  # channel: (event, the arrays in flight, held until the caller's stream waits)
    world = len(generators)
    while True:
        ops = [next(g, None) for g in generators]
        if all(op is None for op in ops):
            break
        if any(op is None for op in ops) or len({op[:2] for op in ops}) != 1:
            raise AssertionError(f"ranks out of step: {[op[:2] if op else None for op in ops]}")
        kind, channel = ops[0][:2]
        with ctx.device:
            if kind == "send":
                ready = cupy.cuda.Event(disable_timing=True)
                ready.record(ctx.stream)
                copy.wait_event(ready)
                for r in range(world):
                    sent, into = ops[(r - 1) % world][2], ops[r][3]
                    for src, dst in zip(sent, into):
                        nbytes = src.size * src.dtype.itemsize
                        cupy.cuda.runtime.memcpyAsync(dst.ptr, src.ptr, nbytes, cupy.cuda.runtime.memcpyDeviceToDevice, copy.ptr)
                event = cupy.cuda.Event(disable_timing=True)
                event.record(copy)
                done[channel] = (event, ops)
            else:
                ctx.stream.wait_event(done.pop(channel)[0])


def _import_shards(named: dict):
    """One call context for every rank's arrays (one framework, one device: the simulation)."""
    flat = {f"{name}[{r}]": x for name, xs in named.items() if xs is not None for r, x in enumerate(xs)}
    ctx, a = boundary.import_arrays(**flat)
    return ctx, {name: None if xs is None else [a[f"{name}[{r}]"] for r in range(len(xs))] for name, xs in named.items()}


def _check_common(q, k, v, world: int, layout: str):
    """Every rank's shards (lists) checked against rank 0's."""
    for name, xs in (("q", q), ("k", k), ("v", v)):
        for r, x in enumerate(xs):
            validation.check_shape(f"{name}[{r}]", x, xs[0].shape, f"(the shape of {name}[0])")
            validation.check_same_dtype(f"{name}[{r}]", x, "q[0]", q[0])
            if name != "q":  # q stays where it is
                _check_contiguous(f"{name}[{r}]", x)
    for r in range(1, len(q)):  # strides and alignment of every rank's, not only rank 0's
        _check_rank(q[r], k[r], v[r], world, layout)
    return _check_rank(q[0], k[0], v[0], world, layout)


def _check_rank(q, k, v, world: int, layout: str, out=None):
    """One rank's shards (and the forward's ``out``, in the backward): their dtype, strides,
    k and v whole buffers (they travel), and the layout of the whole sequence."""
    c_type = check_qkv(q, k, v, out)
    _check_contiguous("k", k)
    _check_contiguous("v", v)
    if q.shape[1] != k.shape[1]:
        raise ValueError(f"ring attention is self-attention: q and k shards must hold as many rows ({q.shape[1]} and {k.shape[1]})")
    layouts.check_layout(layout, q.shape[1] * world, world)
    return c_type


def _check_contiguous(name: str, x) -> None:
    if not _contiguous(x):
        raise ValueError(f"{name} must be contiguous: shards travel around the ring as whole buffers")


def _contiguous(x) -> bool:
    expected, step = [], 1
    for n in reversed(x.shape):
        expected.append(step)
        step *= n
    return tuple(s for s, n in zip(x.strides, x.shape) if n > 1) == tuple(e for e, n in zip(reversed(expected), x.shape) if n > 1)


def ring_attention_simulated(q, k, v, *, layout="zigzag", causal=True, window=None, scale=None, softcap=None, return_lse=False):
    """Ring attention over W ranks, simulated in one process on one GPU.

    ``q``, ``k``, ``v``: lists of W shards (rank r's rows, :func:`cuattn.dist.shard` of the full
    sequence under ``layout``), each ``(batch, seqlen / W, heads, head_dim)``, contiguous.
    Masks as :func:`cuattn.attention` on token positions (self-attention: ``align`` does not
    matter). Returns the list of each rank's ``out`` (and the list of its ``lse``), equal to
    single-device attention over the whole sequence, sharded the same way.
    """
    return_lse = check_bool("return_lse", return_lse)
    world = _world(q)
    _check_shards({"q": q, "k": k, "v": v}, world)
    ctx, s = _import_shards({"q": q, "k": k, "v": v})
    c_type = _check_common(s["q"], s["k"], s["v"], world, layout)
    batch, local, heads_q, head_dim = s["q"][0].shape
    options = AttnOptions.from_user(causal, window, "bottom_right", scale, softcap, head_dim=head_dim)
    left, right = _mask(options)
    ctx.stage(*s["q"], *s["k"], *s["v"])
    outs = [ctx.empty(x.shape, x.dtype) for x in s["q"]]
    lses = [ctx.empty((batch, heads_q, local), np.float32) for _ in range(world)]
    if batch * local * heads_q:
        generators = [
            forward_steps(ctx, c_type, s["q"][r], s["k"][r], s["v"][r], outs[r], lses[r], options, plan(local * world, world, r, layout, left, right))
            for r in range(world)
        ]
        _simulate(ctx, generators)
    outs = [ctx.export(o) for o in outs]
    return (outs, [ctx.export(x) for x in lses]) if return_lse else outs


def ring_attention_backward_simulated(
    dout, q, k, v, out, lse, *, layout="zigzag", causal=True, window=None, scale=None, softcap=None, dlse=None, deterministic=False,
):
    """Gradients of :func:`ring_attention_simulated`: lists of W shards in, ``(dq, dk, dv)``
    lists of W shards out. ``out`` and ``lse`` are the forward's (each rank's global result);
    ``dlse`` optional, a list like ``lse``."""
    deterministic = check_bool("deterministic", deterministic)
    world = _world(q)
    named = {"dout": dout, "q": q, "k": k, "v": v, "out": out, "lse": lse}
    _check_shards({**named, **({} if dlse is None else {"dlse": dlse})}, world)
    ctx, s = _import_shards({**named, "dlse": dlse})
    c_type = _check_common(s["q"], s["k"], s["v"], world, layout)
    batch, local, heads_q, head_dim = s["q"][0].shape
    for r in range(world):
        validation.check_shape(f"out[{r}]", s["out"][r], s["q"][r].shape, "(the shape of q)")
        validation.check_same_dtype(f"out[{r}]", s["out"][r], "q[0]", s["q"][0])
        check_qkv(s["q"][r], s["k"][r], s["v"][r], s["out"][r])  # strides and alignment
        check_dout(s["dout"][r], s["q"][r], c_type, _LAYOUT)
        check_row_stats({"lse": s["lse"][r], "dlse": None if dlse is None else s["dlse"][r]}, ("lse", "dlse"), (batch, heads_q, local))
    options = AttnOptions.from_user(causal, window, "bottom_right", scale, softcap, head_dim=head_dim)
    left, right = _mask(options)
    ctx.stage(*(x for xs in s.values() if xs is not None for x in xs))
    grads = [tuple(ctx.empty(s[n][r].shape, s[n][r].dtype) for n in ("q", "k", "v")) for r in range(world)]
    if batch * local * heads_q:
        generators = []
        for r in range(world):
            a = {n: s[n][r] for n in named}
            a["dlse"] = None if dlse is None else s["dlse"][r]
            generators.append(backward_steps(ctx, c_type, a, grads[r], options, plan(local * world, world, r, layout, left, right), deterministic))
        _simulate(ctx, generators)
    return tuple([ctx.export(g[i]) for g in grads] for i in range(3))


def ring_attention(q, k, v, *, comm, layout="zigzag", causal=True, window=None, scale=None, softcap=None, return_lse=False):
    """Ring attention, one rank per process: this rank's part of attention over a sequence
    whose rows are dealt to the ranks of ``comm`` (a ``torch.distributed`` process group).

    ``q``, ``k``, ``v``: this rank's shards ``(batch, seqlen / W, heads, head_dim)``
    (:func:`cuattn.dist.shard` of the full sequence under ``layout``), k and v contiguous;
    every rank must pass shards of one shape and dtype, the same options, and call in the
    same order (not checked across ranks: that would cost a collective and a host wait each
    call; a mismatch hangs or gives wrong results, as with any collective). Masks as
    :func:`cuattn.attention` on token positions (:func:`cuattn.dist.positions`). Returns this
    rank's rows of single-device attention over the whole sequence (and their ``lse``,
    ``(batch, heads, seqlen / W)`` fp32). K/V travel on NCCL's stream while the previous
    shard is computed; with a non-NCCL group (gloo) each exchange is staged through host
    memory, without overlap. Only the KV heads travel.
    """
    return_lse = check_bool("return_lse", return_lse)
    comm = process_group.check_comm(comm)
    ctx, a = boundary.import_arrays(q=q, k=k, v=v)
    exchange = process_group.ProcessGroupExchange(comm)
    c_type = _check_rank(a["q"], a["k"], a["v"], exchange.world, layout)
    batch, local, heads_q, head_dim = a["q"].shape
    options = AttnOptions.from_user(causal, window, "bottom_right", scale, softcap, head_dim=head_dim)
    left, right = _mask(options)
    ctx.stage(a["q"], a["k"], a["v"])
    out, lse = ctx.empty(a["q"].shape, a["q"].dtype), ctx.empty((batch, heads_q, local), np.float32)
    if batch * local * heads_q:
        work = plan(local * exchange.world, exchange.world, exchange.rank, layout, left, right)
        exchange.drive(ctx, forward_steps(ctx, c_type, a["q"], a["k"], a["v"], out, lse, options, work))
    return (ctx.export(out), ctx.export(lse)) if return_lse else ctx.export(out)


def ring_attention_backward(
    dout, q, k, v, out, lse, *, comm, layout="zigzag", causal=True, window=None, scale=None, softcap=None, dlse=None, deterministic=False,
):
    """Gradients ``(dq, dk, dv)`` of this rank's shards under :func:`ring_attention`, whose
    ``out`` and ``lse`` (this rank's) it takes; ``dlse`` optional, like ``lse``. dK / dV
    accumulate in fp32 as they travel around the ring (twice the bytes of K / V per step),
    each gradient is rounded once; both exchanges overlap the kernels. Every rank of ``comm``
    must call it, in the same order as the forwards."""
    deterministic = check_bool("deterministic", deterministic)
    comm = process_group.check_comm(comm)
    ctx, a = boundary.import_arrays(dout=dout, q=q, k=k, v=v, out=out, lse=lse, dlse=dlse)
    exchange = process_group.ProcessGroupExchange(comm)
    c_type = _check_rank(a["q"], a["k"], a["v"], exchange.world, layout, a["out"])
    batch, local, heads_q, head_dim = a["q"].shape
    check_dout(a["dout"], a["q"], c_type, _LAYOUT)
    check_row_stats({"lse": a["lse"], "dlse": a["dlse"]}, ("lse", "dlse"), (batch, heads_q, local))
    options = AttnOptions.from_user(causal, window, "bottom_right", scale, softcap, head_dim=head_dim)
    left, right = _mask(options)
    ctx.stage(*(x for x in a.values() if x is not None))
    grads = tuple(ctx.empty(a[n].shape, a[n].dtype) for n in ("q", "k", "v"))
    if batch * local * heads_q:
        work = plan(local * exchange.world, exchange.world, exchange.rank, layout, left, right)
        exchange.drive(ctx, backward_steps(ctx, c_type, a, grads, options, work, deterministic))
    return tuple(ctx.export(g) for g in grads)
