"""Backend-neutral kernels of the aggregation rules, screening statistics and outer optimizers (spec/design.md §5).

The numpy backend (`peerloom.backends.numpy.aggregate`) and the torch backend
(`peerloom.backends.torch.aggregate`) run *this* code with their own `Ops` (a handful of elementwise
primitives with an ``out`` argument), so both execute the same IEEE operations in the same order and
produce the same bytes. The rules:

* Work is blocked: every tensor is viewed flat and cut into blocks of `BLOCK` elements; each block is
  reduced over the cohort while it sits in cache, in float64 scratch buffers that are allocated once per
  thread and reused (writing fresh pages costs ~10x reusing them on the target machines).
* Only elementwise operations whose result IEEE 754 fixes exactly are used: float32 -> float64 widening
  (exact), ``+ - * /`` on float64 with one rounding each (no fused multiply-add: every multiply and add is
  its own kernel), ``min``/``max``, and one final rounding to the input dtype (round to nearest even).
* Sums over coordinates (norms, inner products) are never left to a library's ``sum``/``dot``, whose order
  differs between numpy, torch and BLAS builds: each block's terms are added elementwise into `BLOCK`
  float64 *lanes* (block after block, tensors in sorted-name order), and the lanes are then folded by
  halving (``lanes[:h] += lanes[h:2h]``) to one value. That fixed order is the definition of every norm,
  inner product and distance this module returns.
* Threads never change a bit (spec/design.md §5 "Threads never change the bytes"): a `Workspace` made for
  ``threads > 1`` runs each kernel's work on the caller's thread and ``threads - 1`` helpers (numpy and
  torch release the GIL in their kernels), each with buffers of its own. Elementwise kernels split each
  span of `SPAN` coordinates into contiguous runs of blocks (`span_part`); lane sums split the *lanes*
  (`lane_stripe`), so lane j is added to by one thread in block order as with one thread; Gram matrices
  compute each block's product on any thread and add the products in block order on the caller's.
* ``min``/``max`` may order ``-0.0`` and ``+0.0`` differently in different libraries; order statistics
  therefore add ``+0.0`` to their result, which maps ``-0.0`` to ``+0.0`` and changes nothing else.
* Inputs must be finite (screening rejects the rest first). Non-finite values propagate without crashing,
  but their bits (NaN payloads, which of several infinities wins) are not part of the guarantee.

Krum's distances come from the Gram matrix (one float64 BLAS product per block) whose rounding depends
on the BLAS; see `krum_select` for how the selection is nevertheless made identical everywhere. Centered
clipping's distances come from a Gram matrix of members quantized to 19-bit integers per block, whose BLAS
product is exact and therefore the same everywhere (`quantized_gram`).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any, Protocol, TypeVar

BLOCK = 1 << 15
"""Elements per block and number of float64 lanes (a power of two)."""

SPAN = 16 * BLOCK
"""Coordinates per parallel step of the elementwise kernels and the Gram matrices (a multiple of `BLOCK` and
`CC_BLOCK`): the threads share out a span's blocks, and a streamed output gets one write per span."""

MAX_THREADS = 8
"""The most threads a `Workspace` runs a kernel on (memory bandwidth is spent long before)."""

INLINE_WORK = 1 << 16
"""A kernel step over at most this many elements runs its parts one after another on the calling thread
(`Workspace.parallel`): handing a part to a helper thread costs more than computing it (the simulator's
models have tens of parameters). The parts and their workspaces are the same, so are the bytes."""

LANE_ALIGN = 64
"""Lane stripes start at multiples of this many lanes (whole cache lines for float32 and float64)."""

UNIT_ROUNDOFF = 2.0**-53
SORTING_NETWORK_MAX = 32
"""Cohorts up to this size use a pruned Batcher sorting network for order statistics; larger ones sort."""


class Ops(Protocol):
    """Elementwise primitives one backend provides (`peerloom.backends.numpy.aggregate.NUMPY_OPS`...).

    Arrays are 1-D (or 2-D for `gram`, `sort0`, `fold`) contiguous buffers of the backend's array type.
    """

    def empty(self, n: int, dtype: str) -> Any: ...
    def empty2(self, rows: int, n: int, dtype: str) -> Any: ...
    def zeros(self, n: int, dtype: str) -> Any: ...
    def flat(self, t: Any) -> Any: ...
    def new(self, shape: tuple[int, ...], dtype: str) -> Any: ...
    def copy(self, dst: Any, src: Any) -> None: ...
    def fill(self, a: Any, value: float) -> None: ...
    def add(self, a: Any, b: Any) -> None: ...  # a += b
    def sub(self, a: Any, b: Any) -> None: ...  # a -= b
    def mul(self, a: Any, b: Any) -> None: ...  # a *= b
    def scale(self, a: Any, c: float) -> None: ...  # a *= c (c a Python float; a float64)
    def add_scalar(self, a: Any, c: float) -> None: ...  # a += c
    def div_scalar(self, a: Any, c: float) -> None: ...  # a /= c
    def scale_into(self, out: Any, x: Any, c: float) -> None: ...  # out = float64(x) * c
    def mul_into(self, out: Any, x: Any, y: Any) -> None: ...  # out = float64(x) * float64(y)
    def product(self, out: Any, a: Any, b: Any) -> None: ...  # out = a * b, all one dtype
    def minimum(self, out: Any, a: Any, b: Any) -> None: ...
    def maximum(self, out: Any, a: Any, b: Any) -> None: ...
    def gram(self, x: Any, out: Any) -> None: ...  # out = x @ x.T (float64)
    def sort0(self, x: Any) -> Any: ...  # sorted along axis 0 (a new array)
    def item(self, a: Any, i: int) -> float: ...
    def column(self, values: Sequence[float]) -> Any: ...  # [len, 1] float64
    def reshape(self, a: Any, shape: tuple[int, ...]) -> Any: ...  # a view of a contiguous buffer
    def stack(self, out: Any, parts: Sequence[Any]) -> None: ...  # out[i] = parts[i] (one call)
    def absmax_rows(self, x: Any, scratch: Any) -> list[float]: ...  # max |x[i]| per row; scratch like x
    def quantize_rows(self, out: Any, x: Any, scales: Sequence[float]) -> None: ...
    # out[i] = rint(float64(x[i]) * scales[i]), scales powers of two, rint half to even (all exact)
    def errstate(self) -> Any: ...  # context manager silencing overflow on the final rounding


# ---------------------------------------------------------------- cohort layout and buffers


Schema = tuple[tuple[str, str, tuple[int, ...]], ...]


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def segments(schema: Schema) -> list[tuple[str, int, int, int]]:
    """``(name, start, end, offset)`` blocks in sorted-name order; offset is the global flat position."""
    out = []
    offset = 0
    for name, _, shape in schema:
        size = numel(shape)
        for start in range(0, size, BLOCK):
            end = min(size, start + BLOCK)
            out.append((name, start, end, offset + start))
        offset += size
    return out


T = TypeVar("T")


class Workspace:
    """One caller thread's float64 (and input-dtype) buffers, grown on demand and reused between calls; with
    ``threads > 1`` also ``threads - 1`` helper threads, each with a `Workspace` of its own (`parallel`).

    A workspace serves one caller at a time (backends keep one per calling thread and thread count).
    ValueError unless ``1 <= threads <= MAX_THREADS``."""

    def __init__(self, ops: Ops, threads: int = 1) -> None:
        if not 1 <= threads <= MAX_THREADS:
            raise ValueError(f"threads must be in [1, {MAX_THREADS}], got {threads}")
        self.ops = ops
        self.threads = threads
        self._bufs: dict[tuple[str, str], Any] = {}
        self._sizes: dict[tuple[str, str], tuple[int, int]] = {}
        self._helpers = [Workspace(ops) for _ in range(threads - 1)]
        self._pool = ThreadPoolExecutor(threads - 1, thread_name_prefix="peerloom-kernel") if threads > 1 else None

    def parallel(self, part: Callable[[int, Workspace], T], size: int) -> list[T]:
        """``[part(0, self), part(1, helper 1), ...]``: part k of a kernel's work with workspace k, part 0 on
        the calling thread and the others on the helpers. Returns when every part is done; an exception of
        a part is raised then (the first in part order), never while another part still runs. `size` is the
        elements the step covers: up to `INLINE_WORK` every part runs on the calling thread, in order."""
        if self._pool is None:
            return [part(0, self)]
        if size <= INLINE_WORK:
            return [part(k, ws) for k, ws in enumerate((self, *self._helpers))]
        futures = [self._pool.submit(part, k, ws) for k, ws in enumerate(self._helpers, start=1)]
        try:
            first = part(0, self)
        finally:
            wait(futures)
        return [first, *(f.result() for f in futures)]

    def get(self, key: str, rows: int, n: int, dtype: str = "float64") -> Any:
        """A ``[rows, n]`` buffer (``rows == 0``: 1-D ``[n]``) named `key`; contents unspecified."""
        k = (key, dtype)
        have = self._sizes.get(k)
        if have is None or have[0] < rows or have[1] < n:
            r, m = (max(rows, have[0]), max(n, have[1])) if have else (rows, n)
            self._bufs[k] = self.ops.empty2(max(r, 1), m, dtype) if r else self.ops.empty(m, dtype)
            self._sizes[k] = (r, m)
        buf = self._bufs[k]
        if rows == 0:
            return buf[:n] if self._sizes[k][0] == 0 else buf[0, :n]
        return buf[:rows, :n]


_local = threading.local()


def thread_workspace(ops: Any, threads: int = 1) -> Workspace:
    """This thread's reusable buffers for kernels of the backend `ops` on `threads` threads (a `Workspace`, its
    helper threads with their own buffers; one per calling thread, backend and thread count). ValueError
    unless ``1 <= threads <= MAX_THREADS``."""
    spaces = getattr(_local, "spaces", None)
    if spaces is None:
        spaces = _local.spaces = {}
    key = (id(ops), threads)  # each backend's ops is one module-level object
    ws = spaces.get(key)
    if ws is None:
        ws = spaces[key] = Workspace(ops, threads)
    return ws


def flats(ops: Ops, members: Sequence[dict[str, Any]], schema: Schema) -> dict[str, list[Any]]:
    return {name: [ops.flat(m[name]) for m in members] for name, _, _ in schema}


def spans(schema: Schema) -> list[tuple[str, str, int, int]]:
    """``(name, dtype, start, end)``: each tensor's flat coordinates in runs of at most `SPAN`, schema order."""
    return [(name, dtype, start, min(numel(shape), start + SPAN))
            for name, dtype, shape in schema for start in range(0, numel(shape), SPAN)]


def span_part(start: int, end: int, k: int, threads: int, unit: int = BLOCK) -> tuple[int, int]:
    """The coordinates ``[a, b)`` of span ``[start, end)`` that part k of `threads` computes: a contiguous
    run of its blocks of `unit` elements (block boundaries at multiples of `unit` from `start`)."""
    units = -(-(end - start) // unit)
    return (min(end, start + unit * (units * k // threads)), min(end, start + unit * (units * (k + 1) // threads)))


def lane_stripe(k: int, threads: int) -> tuple[int, int]:
    """The lanes ``[lo, hi)`` part k of `threads` accumulates (spec/design.md §5: threads split lanes, never
    blocks). Stripes tile ``[0, BLOCK)`` and start at multiples of `LANE_ALIGN`."""
    def edge(i: int) -> int:
        return BLOCK if i == threads else BLOCK * i // threads // LANE_ALIGN * LANE_ALIGN
    return edge(k), edge(k + 1)


# ---------------------------------------------------------------- deterministic sums


def fold_lanes(ops: Ops, lanes: Any) -> list[float]:
    """Fold ``[rows, BLOCK]`` float64 lanes by halving; returns one Python float per row."""
    h = lanes.shape[1]
    while h > 1:
        h //= 2
        ops.add(lanes[:, :h], lanes[:, h : 2 * h])
    return [ops.item(lanes[r], 0) for r in range(lanes.shape[0])]


def dots(
    ops: Ops,
    ws: Workspace,
    schema: Schema,
    xs: dict[str, list[Any]],
    ys: dict[str, list[Any]] | None = None,
    centre: dict[str, Any] | None = None,
) -> list[float]:
    """Per member i: ``sum((x_i - c) * (y_i - c))`` over all coordinates, in the fixed lane order.

    ``ys=None`` means ``y_i = x_i`` (squared norms); `centre` (flat float64 or input-dtype arrays per name)
    is subtracted from both when given. All in float64.
    """
    rows = len(next(iter(xs.values()))) if xs else 0
    lanes = ws.get("lanes", rows, BLOCK)
    ops.fill(lanes, 0.0)
    blocks = segments(schema)

    def part(k: int, w: Workspace) -> None:
        lo, hi = lane_stripe(k, ws.threads)
        s = w.get("s", 0, BLOCK)
        t = w.get("t", 0, BLOCK)
        for name, start, end, _ in blocks:
            a, b = start + lo, min(end, start + hi)
            if a >= b:
                continue
            n = b - a
            sb, tb = s[:n], t[:n]
            for i in range(rows):
                x = xs[name][i][a:b]
                if centre is None:
                    ops.mul_into(sb, x, x if ys is None else ys[name][i][a:b])
                else:
                    ops.copy(sb, x)
                    ops.sub(sb, centre[name][a:b])
                    if ys is None:
                        ops.mul(sb, sb)
                    else:
                        ops.copy(tb, ys[name][i][a:b])
                        ops.sub(tb, centre[name][a:b])
                        ops.mul(sb, tb)
                ops.add(lanes[i, lo:lo + n], sb)

    if rows:
        ws.parallel(part, rows * sum(end - start for _, start, end, _ in blocks))
    return fold_lanes(ops, lanes) if rows else []


class SquaredNorms:
    """Each tensor's squared L2 norm and the global one, fed block by block: `start` a tensor, `add` its flat
    blocks in order (each starting at a multiple of `BLOCK` of the tensor), `end` it; tensors in sorted-name
    order; then `total`. The same products added into the same lanes in the same order as `dots` on each
    tensor alone and on all of them, however large the blocks fed (they are cut at `BLOCK`), on the
    workspace's threads (each its stripe of lanes)."""

    def __init__(self, ops: Ops, ws: Workspace) -> None:
        self.ops, self.ws = ops, ws
        self.tensor_lanes = ws.get("norm_lanes", 1, BLOCK)
        self.total_lanes = ws.get("total_lanes", 1, BLOCK)
        ops.fill(self.total_lanes, 0.0)
        self.per: dict[str, float] = {}

    def start(self) -> None:
        self.ops.fill(self.tensor_lanes, 0.0)

    def add(self, x: Any) -> None:
        """Add the squares of flat block `x` (an array, or a flat stored tensor that the threads slice)."""
        ops = self.ops
        size = x.shape[0]

        def part(k: int, w: Workspace) -> None:
            lo, hi = lane_stripe(k, self.ws.threads)
            s = w.get("s", 0, BLOCK)
            for i in range(0, size, BLOCK):
                a, b = i + lo, min(size, i + hi)
                if a >= b:
                    continue
                n = b - a
                piece = x[a:b]
                ops.mul_into(s[:n], piece, piece)
                ops.add(self.tensor_lanes[0, lo:lo + n], s[:n])
                ops.add(self.total_lanes[0, lo:lo + n], s[:n])

        self.ws.parallel(part, size)

    def end(self, name: str) -> None:
        self.per[name] = fold_lanes(self.ops, self.tensor_lanes)[0]

    def total(self) -> float:
        return fold_lanes(self.ops, self.total_lanes)[0] if self.per else 0.0


def squared_norms(ops: Ops, ws: Workspace, schema: Schema, flat: dict[str, Any]) -> tuple[dict[str, float], float]:
    """Each tensor's squared L2 norm and the global one, read in one pass (`SquaredNorms`)."""
    norms = SquaredNorms(ops, ws)
    for name, _, _ in schema:
        norms.start()
        norms.add(flat[name])
        norms.end(name)
    return norms.per, norms.total()


# ---------------------------------------------------------------- weighted sums


def normalized(weights: Sequence[int]) -> list[float]:
    total = sum(weights)
    return [w / total for w in weights]


def weighted_sum(
    ops: Ops, ws: Workspace, schema: Schema, fl: dict[str, list[Any]], coeffs: Sequence[float], out: dict[str, Any]
) -> dict[str, Any]:
    """``out = sum_i coeffs[i] * x_i``: per block ``acc = +0.0; acc += float64(x_i) * c_i`` in member order,
    rounded once into `out` (the `peerloom.backends.numpy.reduce` recipe, blocked: `blockwise`)."""

    def block(w: Workspace, name: str, _dtype: str, i: int, j: int, targets: list[Any]) -> None:
        a, sb = w.get("acc", 0, BLOCK)[:j - i], w.get("s", 0, BLOCK)[:j - i]
        ops.fill(a, 0.0)
        for x, c in zip(fl[name], coeffs, strict=True):
            ops.scale_into(sb, x[i:j], c)
            ops.add(a, sb)
        ops.copy(targets[0], a)

    blockwise(ops, ws, schema, [out], block)
    return out


# ---------------------------------------------------------------- order statistics


def batcher_network(n: int) -> list[tuple[int, int]]:
    """Comparators ``(i, j)``, i < j, of Batcher's odd-even merge sort for `n` inputs (Knuth TAOCP 5.3.4),
    padded to a power of two with +inf and the comparators touching the padding removed."""
    size = 1
    while size < n:
        size *= 2
    pairs: list[tuple[int, int]] = []
    p = 1
    while p < size:
        k = p
        while k >= 1:
            for j in range(k % p, size - k, 2 * k):
                for i in range(min(k, size - j - k)):
                    if (i + j) // (2 * p) == (i + j + k) // (2 * p):
                        pairs.append((i + j, i + j + k))
            k //= 2
        p *= 2
    return [(a, b) for a, b in pairs if b < n]


_NETWORKS: dict[tuple[int, tuple[int, ...]], list[tuple[int, int]]] = {}


def pruned_network(n: int, wanted: tuple[int, ...]) -> list[tuple[int, int]]:
    """The comparators of `batcher_network` that the sorted positions `wanted` depend on."""
    key = (n, wanted)
    if key not in _NETWORKS:
        need = set(wanted)
        kept = []
        for a, b in reversed(batcher_network(n)):
            if a in need or b in need:
                kept.append((a, b))
                need.update((a, b))
        _NETWORKS[key] = kept[::-1]
    return _NETWORKS[key]


def order_statistics(ops: Ops, ws: Workspace, dtype: str, xs: list[Any], start: int, end: int,
                     wanted: tuple[int, ...]) -> list[Any]:
    """Buffers of `ws` where ``rows[p]`` holds sorted position ``wanted[p]`` of ``x[start:end]`` over the
    members `xs` (at most `BLOCK` coordinates; valid until `ws` computes the next).

    Up to `SORTING_NETWORK_MAX` members: the pruned sorting network on input-dtype buffers (min/max are
    exact); beyond: the backend's sort along the member axis. Either way the values are the order
    statistics; only the sign of zeros may differ, which the callers canonicalize.
    """
    n = len(xs)
    m = end - start
    work = ws.get("order", n + 1, BLOCK, dtype)
    rows = [work[i, :m] for i in range(n)]
    for i in range(n):
        ops.copy(rows[i], xs[i][start:end])
    if n > SORTING_NETWORK_MAX:
        ordered = ops.sort0(work[:n, :m])
        return [ordered[p] for p in wanted]
    spare = work[n, :m]
    for a, b in pruned_network(n, wanted):
        ops.minimum(spare, rows[a], rows[b])
        ops.maximum(rows[b], rows[a], rows[b])
        rows[a], spare = spare, rows[a]
    return [rows[p] for p in wanted]


def blockwise(ops: Ops, ws: Workspace, schema: Schema, out: Sequence[dict[str, Any] | None],
              block: Callable[[Workspace, str, str, int, int, list[Any]], None]) -> None:
    """Run an elementwise kernel: ``block(w, name, dtype, i, j, targets)`` computes coordinates ``i..j`` (at
    most `BLOCK`) of tensor `name` into ``targets[o]``, the matching slices of the outputs `out` (None
    entries stay None), with workspace `w`. Per span (`spans`), this thread takes each output's slice (a
    streamed output's buffer, in order), then the threads compute their runs of blocks (`span_part`) under
    the backend's error state (thread-local in numpy)."""
    for name, dtype, start, end in spans(schema):
        spanned = [None if o is None else ops.flat(o[name])[start:end] for o in out]

        def part(k: int, w: Workspace, name: str = name, dtype: str = dtype, start: int = start, end: int = end,
                 spanned: list[Any] = spanned) -> None:
            first, last = span_part(start, end, k, ws.threads)
            with ops.errstate():
                for i in range(first, last, BLOCK):
                    j = min(last, i + BLOCK)
                    block(w, name, dtype, i, j, [None if t is None else t[i - start:j - start] for t in spanned])

        ws.parallel(part, end - start)


def median(ops: Ops, ws: Workspace, schema: Schema, fl: dict[str, list[Any]], out: dict[str, Any]) -> dict[str, Any]:
    """Coordinate-wise median; for an even count the mean of the two middle values, ``(a + b) * 0.5`` in
    float64 rounded once (not the lower middle value `torch.median` returns)."""
    n = len(next(iter(fl.values())))
    wanted = ((n - 1) // 2,) if n % 2 else (n // 2 - 1, n // 2)

    def block(w: Workspace, name: str, dtype: str, i: int, j: int, targets: list[Any]) -> None:
        rows = order_statistics(ops, w, dtype, fl[name], i, j, wanted)
        if n % 2:
            ops.add_scalar(rows[0], 0.0)
            ops.copy(targets[0], rows[0])
        else:
            s, t = w.get("s", 0, BLOCK)[:j - i], w.get("t", 0, BLOCK)[:j - i]
            ops.copy(s, rows[0])
            ops.copy(t, rows[1])
            ops.add(s, t)
            ops.scale(s, 0.5)
            ops.add_scalar(s, 0.0)
            ops.copy(targets[0], s)

    blockwise(ops, ws, schema, [out], block)
    return out


def trimmed_mean(
    ops: Ops, ws: Workspace, schema: Schema, fl: dict[str, list[Any]], trim: int, out: dict[str, Any]
) -> dict[str, Any]:
    """Coordinate-wise mean of the sorted positions ``trim .. n - trim - 1``: float64, ascending order,
    accumulator from +0.0, divided by the count, rounded once."""
    n = len(next(iter(fl.values())))
    wanted = tuple(range(trim, n - trim))

    def block(w: Workspace, name: str, dtype: str, i: int, j: int, targets: list[Any]) -> None:
        rows = order_statistics(ops, w, dtype, fl[name], i, j, wanted)
        a, sb = w.get("acc", 0, BLOCK)[:j - i], w.get("s", 0, BLOCK)[:j - i]
        ops.fill(a, 0.0)
        for row in rows:
            ops.copy(sb, row)
            ops.add(a, sb)
        ops.div_scalar(a, float(len(wanted)))
        ops.copy(targets[0], a)

    blockwise(ops, ws, schema, [out], block)
    return out


# ---------------------------------------------------------------- Krum


def gram(ops: Ops, ws: Workspace, schema: Schema, fl: dict[str, list[Any]]) -> list[list[float]]:
    """``G[i][j] = <x_i, x_j>`` in float64 via one BLAS product per block (rounding order is the BLAS's),
    the products added in block order (`block_products`)."""
    n = len(next(iter(fl.values())))

    def product(w: Workspace, name: str, _dtype: str, start: int, end: int, part: Any) -> None:
        x = w.get("gram_x", n, BLOCK)[:, :end - start]
        for i in range(n):
            ops.copy(x[i], fl[name][i][start:end])
        ops.gram(x, part)

    total = block_products(ops, ws, schema, n, BLOCK, product)
    return [[ops.item(total, i * n + j) for j in range(n)] for i in range(n)]


def block_products(ops: Ops, ws: Workspace, schema: Schema, n: int, unit: int,
                   product: Callable[[Workspace, str, str, int, int, Any], None]) -> Any:
    """``sum_b P_b``, float64 ``[n * n]`` in `ws`: ``product(w, name, dtype, start, end, P)`` writes block b's
    ``[n, n]`` matrix (coordinates ``start..end``, blocks of `unit` per tensor) with workspace `w`. The
    threads compute runs of each span's blocks; this thread adds the products into the total in block
    order (tensors in schema order), so the sum is the one-thread sum bit for bit (spec/design.md §5)."""
    total = ws.get("products", 0, n * n)
    ops.fill(total, 0.0)
    per_span = SPAN // unit
    for name, dtype, start, end in spans(schema):
        def part(k: int, w: Workspace, name: str = name, dtype: str = dtype, start: int = start,
                 end: int = end) -> list[Any]:
            first, last = span_part(start, end, k, ws.threads, unit)
            parts = w.get("block_products", per_span, n * n)
            done = []
            for b, i in enumerate(range(first, last, unit)):
                product(w, name, dtype, i, min(last, i + unit), ops.reshape(parts[b], (n, n)))
                done.append(parts[b])
            return done

        for done in ws.parallel(part, end - start):
            for p in done:
                ops.add(total, p)
    return total


def krum_scores(dist: list[list[float]], neighbours: int) -> list[float]:
    n = len(dist)
    return [sum(sorted(dist[i][j] for j in range(n) if j != i)[:neighbours]) for i in range(n)]


def krum_select(
    ops: Ops, ws: Workspace, schema: Schema, fl: dict[str, list[Any]], f: int, m: int
) -> tuple[list[int], bool]:
    """Indices (ascending) of the `m` members with the smallest Krum scores (Blanchard et al. 2017,
    "Machine Learning with Adversaries", NeurIPS; multi-Krum keeps `m`), ties to the lower index; and
    whether the exact fallback ran.

    Score_i = sum of the ``n - f - 2`` smallest squared distances from x_i to the others (at least 0 and at
    most ``n - 1`` neighbours). Distances are computed from the float64 Gram matrix,
    ``|x_i|^2 + |x_j|^2 - 2<x_i, x_j>``, whose error for any summation order is at most
    ``gamma_K (|x_i| + |x_j|)^2`` with ``gamma_K = K u / (1 - K u)`` (K coordinates, u = 2^-53; Higham,
    *Accuracy and Stability*, §3.1). If the selected and rejected scores are separated by more than three
    times their error bounds, the selection is the one exact arithmetic makes, on every machine and BLAS.
    Otherwise (near-ties: duplicate members, colluders) every distance is recomputed directly as
    ``sum((x_i - x_j)^2)`` in the fixed lane order (elementwise, identical on every backend) and the
    selection is made from those. Either way all backends and machines select the same set.
    """
    n = len(next(iter(fl.values())))
    neighbours = max(0, min(n - 1, n - f - 2))
    if m >= n:
        return list(range(n)), False
    k = sum(numel(shape) for _, _, shape in schema)
    g = gram(ops, ws, schema, fl)
    gamma = 2.0 * (k + 8) * UNIT_ROUNDOFF / (1.0 - (k + 8) * UNIT_ROUNDOFF)
    norms = [math.sqrt(max(g[i][i], 0.0)) for i in range(n)]
    dist = [[max(g[i][i] + g[j][j] - 2.0 * g[i][j], 0.0) for j in range(n)] for i in range(n)]
    err = [
        neighbours * max((gamma * (norms[i] + norms[j]) ** 2 for j in range(n) if j != i), default=0.0)
        for i in range(n)
    ]
    scores = krum_scores(dist, neighbours)
    order = sorted(range(n), key=lambda i: (scores[i], i))
    chosen, rest = order[:m], order[m:]
    if max(scores[i] + 3 * err[i] for i in chosen) < min(scores[j] - 3 * err[j] for j in rest):
        return sorted(chosen), False
    exact = exact_distances(ops, ws, schema, fl)
    scores = krum_scores(exact, neighbours)
    order = sorted(range(n), key=lambda i: (scores[i], i))
    return sorted(order[:m]), True


def exact_distances(ops: Ops, ws: Workspace, schema: Schema, fl: dict[str, list[Any]]) -> list[list[float]]:
    """All pairwise ``sum((x_i - x_j)^2)`` in float64 and the fixed lane order (symmetric, zero diagonal)."""
    n = len(next(iter(fl.values())))
    dist = [[0.0] * n for _ in range(n)]
    for i in range(n):
        others = list(range(i + 1, n))
        if not others:
            continue
        xs = {name: [fl[name][j] for j in others] for name in fl}
        centre = {name: fl[name][i] for name in fl}
        for j, d in zip(others, dots(ops, ws, schema, xs, centre=centre), strict=True):
            dist[i][j] = dist[j][i] = d
    return dist


# ---------------------------------------------------------------- clipping


def clip_factor(norm: float, tau: float) -> float:
    """``min(1, tau / norm)`` (1 for a zero norm)."""
    return 1.0 if norm <= tau or norm == 0.0 else tau / norm


def median_of(values: Sequence[float]) -> float:
    v = sorted(values)
    n = len(v)
    return v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2])


CC_BLOCK = 1 << 14
"""Coordinates per block of `centered_clip`'s quantized Gram matrix (a power of two)."""

CC_QUANT_BITS = 19
"""Each member's block is scaled by a power of two and rounded to integers of magnitude <= 2^19, so every
partial sum of one block's inner products is an integer of magnitude <= ``CC_BLOCK * 2^38 = 2^52``: exact
in float64 whatever order a BLAS sums them in."""


def quantized_gram(ops: Ops, ws: Workspace, schema: Schema, rows: dict[str, list[Any]]) -> list[list[float]]:
    """Inner products ``G[i][j] ~ <x_i, x_j>`` that every machine and BLAS computes to the same bits.

    Per block of `CC_BLOCK` coordinates and per row i: ``s_i = 2^(CC_QUANT_BITS - e_i)`` with ``e_i`` the
    binary exponent of ``max |x_i|`` over the block (``frexp``; 1 for an all-zero block), ``q_i =
    rint(float64(x_i) * s_i)`` (exact scaling, round half to even), so ``|q_i| <= 2^CC_QUANT_BITS``. The
    block's ``Q Q^T`` (one BLAS call) is exact (integers below 2^53, see `CC_QUANT_BITS`); it is scaled by
    ``1 / (s_i s_j)`` (powers of two: exact) and added to the float64 total, block after block in schema
    order (elementwise adds, identical on every backend). Relative to the true inner products the error is
    about ``2^-CC_QUANT_BITS`` of the block maxima.
    """
    n = len(next(iter(rows.values())))

    def product(w: Workspace, name: str, dtype: str, start: int, end: int, part: Any) -> None:
        m = end - start
        x = ops.reshape(w.get("cc_x", 0, n * CC_BLOCK, dtype)[: n * m], (n, m))
        ops.stack(x, [r[start:end] for r in rows[name]])
        scratch = ops.reshape(w.get("cc_abs", 0, n * CC_BLOCK, dtype)[: n * m], (n, m))
        exps = [math.frexp(a)[1] if a > 0.0 else 0 for a in ops.absmax_rows(x, scratch)]
        q = ops.reshape(w.get("cc_q", 0, n * CC_BLOCK)[: n * m], (n, m))
        ops.quantize_rows(q, x, [math.ldexp(1.0, CC_QUANT_BITS - e) for e in exps])
        ops.gram(q, part)
        inv = ops.column([math.ldexp(1.0, e - CC_QUANT_BITS) for e in exps])
        smat = ops.reshape(w.get("cc_smat", 0, n * n), (n, n))
        ops.mul_into(smat, inv, ops.reshape(inv, (1, n)))
        ops.mul(part, smat)

    total = block_products(ops, ws, schema, n, CC_BLOCK, product)
    return [[ops.item(total, i * n + j) for j in range(n)] for i in range(n)]


def centered_clip(
    ops: Ops,
    ws: Workspace,
    schema: Schema,
    fl: dict[str, list[Any]],
    coeffs: Sequence[float],
    tau: float | None,
    iterations: int,
    centre: dict[str, list[Any]] | None,
    out: dict[str, Any],
) -> dict[str, Any]:
    """Centered clipping (Karimireddy, He, Jaggi 2021, arXiv 2012.10333, eq. 2):
    ``v <- v + sum_i a_i (x_i - v) min(1, tau / |x_i - v|)``, `iterations` times, from `centre` (default 0).

    Every iterate is a linear combination ``v_t = b_t centre + sum_j w_j^t x_j``: with the Python floats
    ``c_i = a_i min(1, tau / |x_i - v_t|)`` and ``C = sum_i c_i``, ``w <- (1 - C) w + c`` and ``b <- (1 - C) b``
    (``v <- (1 - C) v + sum_i c_i x_i``, equal to eq. 2 in exact arithmetic). So the distances come from one
    Gram matrix of the members (and the centre), ``|x_i - v|^2 = G_ii - 2 (sum_j w_j G_ij + b G_ic) +
    (w^T G w + 2 b sum_j w_j G_jc + b^2 G_cc)`` in Python floats (clamped at 0), and the cohort is read
    twice in all: once for `quantized_gram` (exact on every machine and BLAS, ~2^-19 relative to the block
    maxima — the distances only set the clipping factors) and once for the final ``v = sum_j w_j x_j +
    b centre`` with the `weighted_sum` recipe (float64, member order, the centre last, rounded once).
    ``tau=None`` uses the median distance of the current iteration.
    """
    n = len(coeffs)
    rows = fl if centre is None else {name: [*fl[name], centre[name][0]] for name in fl}
    g = quantized_gram(ops, ws, schema, rows)
    w = [0.0] * n
    b = 0.0 if centre is None else 1.0
    for _ in range(iterations):
        gw = [sum(w[j] * g[i][j] for j in range(n)) for i in range(n)]  # <x_i, sum_j w_j x_j>
        vsq = sum(w[i] * gw[i] for i in range(n))
        if centre is None:
            cross = gw
        else:
            cross = [gw[i] + b * g[i][n] for i in range(n)]
            vsq += 2.0 * b * sum(w[j] * g[j][n] for j in range(n)) + b * b * g[n][n]
        dist = [math.sqrt(max(g[i][i] - 2.0 * cross[i] + vsq, 0.0)) for i in range(n)]
        radius = median_of(dist) if tau is None else float(tau)
        cs = [a * clip_factor(d, radius) for a, d in zip(coeffs, dist, strict=True)]
        keep = 1.0 - sum(cs)
        w = [keep * wi + ci for wi, ci in zip(w, cs, strict=True)]
        b *= keep
    return weighted_sum(ops, ws, schema, rows, w if centre is None else [*w, b], out)


# ---------------------------------------------------------------- outer optimizers


def outer_momentum(
    ops: Ops,
    ws: Workspace,
    schema: Schema,
    params: dict[str, Any],
    grad: dict[str, Any],
    buf: dict[str, Any] | None,
    lr: float,
    momentum: float,
    nesterov: bool,
    out: dict[str, Any],
    out_buf: dict[str, Any] | None,
) -> None:
    """SGD with (Nesterov) momentum, PyTorch's formulation (`torch.optim.SGD`, as DiLoCo uses it):
    ``b' = momentum * b + g``; ``step = g + momentum * b'`` (Nesterov) or ``b'`` (heavy ball) or ``g``
    (momentum 0); ``p' = p - lr * step``. float64 per block, one multiply or add per kernel in exactly this
    order, ``b'`` rounded to the params dtype (that rounded value is used for the step), ``p'`` rounded once.
    Blocked by `blockwise`; `out` and `out_buf` may be streamed outputs (written span by span, in order).
    """
    flat_params = {name: ops.flat(t) for name, t in params.items()}
    flat_grad = {name: ops.flat(t) for name, t in grad.items()}
    flat_buf = None if buf is None else {name: ops.flat(t) for name, t in buf.items()}

    def block(w: Workspace, name: str, _dtype: str, i: int, j: int, targets: list[Any]) -> None:
        new, nb = targets
        a, sb = w.get("acc", 0, BLOCK)[:j - i], w.get("s", 0, BLOCK)[:j - i]
        g = flat_grad[name][i:j]
        if nb is not None:
            if flat_buf is None:
                ops.fill(a, 0.0)
            else:
                ops.copy(a, flat_buf[name][i:j])
            ops.scale(a, momentum)
            ops.copy(sb, g)
            ops.add(a, sb)
            ops.copy(nb, a)  # b' rounded to the state dtype
            if nesterov:
                ops.copy(a, nb)
                ops.scale(a, momentum)
                ops.add(a, sb)
            else:
                ops.copy(a, nb)
        else:
            ops.copy(a, g)
        ops.scale(a, lr)
        ops.copy(sb, flat_params[name][i:j])
        ops.sub(sb, a)
        ops.copy(new, sb)

    blockwise(ops, ws, schema, [out, out_buf], block)


# ---------------------------------------------------------------- the dispatcher both backends share

RULES = ("mean", "median", "trimmed_mean", "krum", "multi_krum", "centered_clip", "norm_clip")
DEFAULT_RULE = "centered_clip"

_PARAMS: dict[str, frozenset[str]] = {
    "mean": frozenset(),
    "median": frozenset(),
    "trimmed_mean": frozenset({"trim_fraction"}),
    "krum": frozenset({"f"}),
    "multi_krum": frozenset({"f", "m"}),
    "centered_clip": frozenset({"tau", "iterations", "center"}),
    "norm_clip": frozenset({"tau"}),
}


def default_f(n: int) -> int:
    """The largest f Krum tolerates for n members: ``n >= 2f + 3``."""
    return max(0, (n - 3) // 2)


def run_rule(
    ops: Ops,
    ws: Workspace,
    schema: Schema,
    members: Sequence[dict[str, Any]],
    weights: Sequence[int],
    rule: str,
    params: dict[str, Any],
    new: Callable[[], dict[str, Any]],
    to_flat: Callable[[dict[str, Any]], dict[str, list[Any]]],
) -> dict[str, Any]:
    """Validate `params` for `rule` and run it. `new()` makes the output dict; `to_flat` flattens a dict."""
    if rule not in _PARAMS:
        raise ValueError(f"unknown aggregation rule {rule!r}; known: {', '.join(RULES)}")
    unknown = set(params) - _PARAMS[rule]
    if unknown:
        raise TypeError(f"rule {rule!r} takes no parameter(s) {sorted(unknown)}")
    n = len(members)
    fl = flats(ops, members, schema)
    coeffs = normalized(weights)
    if rule == "mean":
        return weighted_sum(ops, ws, schema, fl, coeffs, new())
    if rule == "median":
        return median(ops, ws, schema, fl, new())
    if rule == "trimmed_mean":
        beta = float(params.get("trim_fraction", 0.2))
        if not 0.0 <= beta < 0.5:
            raise ValueError(f"trim_fraction must be in [0, 0.5), got {beta}")
        trim = math.floor(beta * n)
        return trimmed_mean(ops, ws, schema, fl, trim, new())
    if rule in ("krum", "multi_krum"):
        f = params.get("f")
        f = default_f(n) if f is None else int(f)
        if f < 0:
            raise ValueError(f"f must be >= 0, got {f}")
        m = 1 if rule == "krum" else params.get("m")
        m = max(1, n - f) if m is None else int(m)
        if not 1 <= m <= n:
            raise ValueError(f"m must be in [1, {n}], got {m}")
        chosen, _ = krum_select(ops, ws, schema, fl, f, m)
        chosen_weights = [weights[i] for i in chosen]
        sub = {name: [fl[name][i] for i in chosen] for name in fl}
        return weighted_sum(ops, ws, schema, sub, normalized(chosen_weights), new())
    if rule == "centered_clip":
        iterations = int(params.get("iterations", 3))
        if iterations < 1:
            raise ValueError(f"iterations must be >= 1, got {iterations}")
        tau = params.get("tau")
        if tau is not None and not float(tau) > 0.0:
            raise ValueError(f"tau must be > 0, got {tau}")
        centre = params.get("center")
        centre_fl = None
        if centre is not None:
            centre_fl = to_flat(centre)
        return centered_clip(ops, ws, schema, fl, coeffs, tau, iterations, centre_fl, new())
    # norm_clip
    tau = params.get("tau")
    if tau is not None and not float(tau) > 0.0:
        raise ValueError(f"tau must be > 0, got {tau}")
    norms = [math.sqrt(max(d, 0.0)) for d in dots(ops, ws, schema, fl)]
    radius = median_of(norms) if tau is None else float(tau)
    cs = [a * clip_factor(d, radius) for a, d in zip(coeffs, norms, strict=True)]
    return weighted_sum(ops, ws, schema, fl, cs, new())


# ---------------------------------------------------------------- screening statistics


def screening_stats(
    ops: Ops, ws: Workspace, schema: Schema, delta: dict[str, Any], reference: dict[str, Any] | None,
    centre: dict[str, Any] | None,
) -> dict[str, Any]:
    """``{"norms": {name: L2}, "global_norm", "cosine" (to `reference`, NaN without one or for a zero norm),
    "distance" (L2 to `centre`, NaN without one)}``; every sum a float64 lane sum (identical on backends)."""
    per, total = squared_norms(ops, ws, schema, {n: ops.flat(delta[n]) for n in delta})
    out: dict[str, Any] = {"norms": {n: math.sqrt(v) for n, v in per.items()}, "global_norm": math.sqrt(total)}
    out["cosine"] = math.nan
    if reference is not None:
        fl = {n: [ops.flat(delta[n])] for n in delta}
        dot = dots(ops, ws, schema, fl, {n: [ops.flat(reference[n])] for n in reference})[0]
        rn = dots(ops, ws, schema, {n: [ops.flat(reference[n])] for n in reference})[0]
        if total > 0.0 and rn > 0.0:
            out["cosine"] = dot / (math.sqrt(total) * math.sqrt(rn))
    out["distance"] = math.nan
    if centre is not None:
        d = dots(ops, ws, schema, {n: [ops.flat(delta[n])] for n in delta},
                 centre={n: ops.flat(centre[n]) for n in centre})[0]
        out["distance"] = math.sqrt(max(d, 0.0))
    return out
