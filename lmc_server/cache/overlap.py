"""Do the pages of two layers share a byte? Interval arithmetic on strides, no page lists.

A layer's pages in a buffer are the half-open ranges ``[o + k*s, o + k*s + p)`` for block
``k`` in ``0..n-1`` (offset ``o``, block stride ``s``, page bytes ``p``). Enumerating
pages would cost ``layers x blocks`` (10^7 for 100 layers of 100k blocks) per
registration; everything here is O(1) or O(log) per pair of layers instead.

Page ``k`` of A and page ``j`` of B overlap iff ``-pA < (oA + k*sA) - (oB + j*sB) < pB``.

* Equal strides: the difference is ``D + t*s`` with ``t = k - j``, so the pairs that
  overlap are those whose ``t`` lies in one integer interval (:func:`_equal_stride_ts`).
* Unequal strides: for each ``k`` the ``j`` that overlap form an integer interval whose
  ends are floors of linear functions of ``k``; the number of overlapping pairs is a sum
  of such floors, computed with :func:`floor_sum` in O(log) steps.

Which pairs to test (:func:`candidate_pairs`): only layers whose extents intersect, and,
for equal strides, whose positions within the stride intersect, by a sort + sweep on the
axis with fewer intersecting pairs, so interleaved and layer-major layouts stay
near-linear in the number of layers.

Groups that share a buffer also share a block-id space (vLLM's hybrid allocator hands a
block id to one group at a time, and lays the groups' layers over one tensor), so pages of
*different* groups may coincide for the *same* block id; any other overlap is refused.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Pages:
    """One layer's pages: ``n`` blocks of ``page`` bytes, ``stride`` apart from ``offset``."""

    offset: int
    stride: int
    page: int
    n: int

    @property
    def end(self) -> int:
        """One past the last byte of the last page (the hull is ``[offset, end)``)."""
        return self.offset + (self.n - 1) * self.stride + self.page


def floor_sum(n: int, m: int, a: int, b: int) -> int:
    """``sum(floor((a*i + b) / m) for i in range(n))`` in O(log) steps (``m > 0``).

    The Euclid-like reduction of AtCoder Library's ``floor_sum``; Python integers do not
    overflow, and ``divmod`` first brings negative ``a`` and ``b`` into ``0..m-1``.
    """
    if n <= 0:
        return 0
    ans = 0
    q, a = divmod(a, m)
    ans += q * (n * (n - 1) // 2)
    q, b = divmod(b, m)
    ans += q * n
    while True:
        if a >= m:
            ans += (n * (n - 1) // 2) * (a // m)
            a %= m
        if b >= m:
            ans += n * (b // m)
            b %= m
        y_max = a * n + b
        if y_max < m:
            return ans
        n, b = divmod(y_max, m)
        m, a = a, m


def _ceil_div(x: int, y: int) -> int:
    return -((-x) // y)


def _equal_stride_ts(a: Pages, b: Pages) -> tuple[int, int]:
    """Equal strides: the inclusive range of ``t = k - j`` whose pages overlap."""
    s, d = a.stride, a.offset - b.offset
    t_lo = (-a.page - d) // s + 1  # d + t*s > -pA
    t_hi = _ceil_div(b.page - d, s) - 1  # d + t*s < pB
    return max(t_lo, -(b.n - 1)), min(t_hi, a.n - 1)


def _pairs(a: Pages, b: Pages) -> int:
    """Number of (k, j) in ``[0, nA) x [0, nB)`` whose pages overlap (any strides)."""
    d = a.offset - b.offset
    # j overlaps k iff k*sA + c1 <= j*sB <= k*sA + c2.
    c1, c2 = d - b.page + 1, d + a.page - 1
    sa, sb = a.stride, b.stride

    def at_least(jmin: int) -> int:
        """Pairs with ``j >= jmin``: U_k = floor((k*sA + c2)/sB) and L_k = ceil(...)."""
        # L_k >= jmin from k_l on; U_k >= jmin from k_u on (both non-decreasing in k).
        k_l = min(max(_ceil_div((jmin - 1) * sb - c1 + 1, sa), 0), a.n)
        k_u = min(max(_ceil_div(jmin * sb - c2, sa), 0), a.n)
        total = 0
        if k_l < a.n:  # sum of U_k - L_k + 1 over k_l..nA-1
            m = a.n - k_l
            total += floor_sum(m, sb, sa, k_l * sa + c2) - floor_sum(m, sb, sa, k_l * sa + c1 - 1)
        if k_u < k_l:  # sum of U_k - jmin + 1 over k_u..k_l-1
            m = k_l - k_u
            total += floor_sum(m, sb, sa, k_u * sa + c2) - m * (jmin - 1)
        return total

    return at_least(0) - at_least(b.n)


def _diagonal(a: Pages, b: Pages) -> int:
    """Number of ``k`` whose page k of A overlaps page k of B (the same block id)."""
    n = min(a.n, b.n)
    d, e = a.offset - b.offset, a.stride - b.stride  # difference at k: d + k*e
    if e == 0:
        return n if -a.page < d < b.page else 0
    if e > 0:
        lo, hi = (-a.page - d) // e + 1, _ceil_div(b.page - d, e) - 1
    else:
        lo, hi = (b.page - d) // e + 1, _ceil_div(-a.page - d, e) - 1
    return max(0, min(hi, n - 1) - max(lo, 0) + 1)


def overlap(a: Pages, b: Pages, same_block_ok: bool) -> tuple[int, int] | None:
    """A block pair ``(k, j)`` whose pages overlap, or ``None``.

    With ``same_block_ok`` (layers of different groups), overlaps with ``k == j`` are
    allowed. For unequal strides the witness is ``(-1, -1)`` (an overlap exists; finding
    one is not worth the arithmetic).
    """
    if a.offset >= b.end or b.offset >= a.end:
        return None
    if a.n == 1 and b.n == 1:  # the hulls are the pages, and they intersect
        return None if same_block_ok else (0, 0)
    # A single page's stride never matters: give it the other layer's (or any positive
    # one), so the equal-stride arithmetic applies.
    if a.n == 1 and a.stride != b.stride:
        a = Pages(a.offset, b.stride, a.page, 1)
    if b.n == 1 and b.stride != a.stride:
        b = Pages(b.offset, a.stride, b.page, 1)
    if a.stride == b.stride:
        lo, hi = _equal_stride_ts(a, b)
        if lo > hi or (same_block_ok and lo == hi == 0):
            return None
        t = hi if same_block_ok and lo == 0 else lo
        k = max(t, 0)
        return k, k - t
    n = _pairs(a, b) - (_diagonal(a, b) if same_block_ok else 0)
    return (-1, -1) if n > 0 else None


def residue_spans(p: Pages) -> list[tuple[int, int]]:
    """Where ``p``'s pages fall within one block stride: ``[r, r + page)`` with
    ``r = offset % stride``, split in two if it wraps past the stride."""
    r = p.offset % p.stride
    if r + p.page <= p.stride:
        return [(r, r + p.page)]
    return [(r, p.stride), (0, r + p.page - p.stride)]


def count_intersecting(spans: list[tuple[int, int]]) -> int:
    """Pairs of half-open spans that intersect, in O(n log n) without listing them: all
    pairs minus the disjoint ones (a disjoint pair has exactly one span ending at or
    before the other's start)."""
    starts = sorted(s for s, _ in spans)
    n = len(spans)
    disjoint = sum(n - bisect_left(starts, e) for _, e in spans)
    return n * (n - 1) // 2 - disjoint


def intersecting_pairs(spans: list[tuple[int, int, int]]) -> Iterator[tuple[int, int]]:
    """Ids ``(i, j)`` of spans ``(start, end, id)`` that intersect: a sweep by start with
    the spans still open; costs O(n log n + pairs). A pair may come twice (an entry with
    two spans); ``i == j`` never comes."""
    active: list[tuple[int, int]] = []  # (end, id)
    for start, end, ident in sorted(spans):
        active = [a for a in active if a[0] > start]
        for _, other in active:
            if other != ident:
                yield other, ident
        active.append((end, ident))


def candidate_pairs(entries: list[Pages]) -> Iterator[tuple[int, int]]:
    """Index pairs of ``entries`` that may overlap; every overlapping pair comes.

    Equal strides (one stride class): two layers can only share bytes if their extents
    intersect *and* their positions within the stride intersect. Layer-major layouts have
    disjoint extents, interleaved ones (vLLM's layers within one block stride) disjoint
    positions; the sweep runs on whichever axis has fewer intersecting pairs (counted in
    O(n log n) first), so both stay near-linear. Across stride classes, extents only.
    """
    classes: dict[int, list[int]] = {}
    for i, p in enumerate(entries):
        classes.setdefault(p.stride if p.n > 1 else -1, []).append(i)
    for stride, members in classes.items():
        hull = [(entries[i].offset, entries[i].end, i) for i in members]
        if stride <= 0:  # single pages: their extents are the pages
            yield from intersecting_pairs(hull)
            continue
        within = [(s, e, i) for i in members for s, e in residue_spans(entries[i])]
        by_hull = count_intersecting([(s, e) for s, e, _ in hull])
        by_within = count_intersecting([(s, e) for s, e, _ in within])
        yield from intersecting_pairs(within if by_within < by_hull else hull)
    if len(classes) > 1:
        cls = {i: stride for stride, members in classes.items() for i in members}
        hull = [(p.offset, p.end, i) for i, p in enumerate(entries)]
        for i, j in _cross_class_pairs(hull, cls):
            yield i, j


def _cross_class_pairs(
    spans: list[tuple[int, int, int]], cls: dict[int, int]
) -> Iterator[tuple[int, int]]:
    """Like :func:`intersecting_pairs`, only pairs of different classes, keeping one
    open list per class so same-class spans are never walked."""
    active: dict[int, list[tuple[int, int]]] = {}
    for start, end, ident in sorted(spans):
        mine = cls[ident]
        for c in list(active):
            active[c] = [a for a in active[c] if a[0] > start]
            if c != mine:
                for _, other in active[c]:
                    yield other, ident
        active.setdefault(mine, []).append((end, ident))
