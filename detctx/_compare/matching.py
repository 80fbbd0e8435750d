"""Pair equal keys of two integer sequences in order, in time linear in their length.

:func:`match` walks both sequences from the start, in step while they
agree (compared a block at a time in NumPy). Where they part, it searches
for the fewest keys to pass over, on both sides together, to be back in step
for :data:`RUN` equal keys in a row, or at both ends: Myers' O((N+M)D)
search, D bounded by :data:`EDITS` and by the nearest place where
:data:`RUN` equal keys start (every run of :data:`RUN` keys is hashed to
find it; no search where no key within that many is on both sides). Equal
keys met on the way pair too. Where the search finds no way back within
:data:`EDITS` keys, the walk jumps to that place, and the region passed over
is matched with :class:`difflib.SequenceMatcher` when it is small (at most
:data:`GAP_CELLS` pairs of keys), else left unpaired. Once no such place is
left, the ends are the next place in step: the keys equal up to both ends
pair (a module's last op, after one fused kernel in A and its unfused ops in
B), and what is left between is searched, or matched as a region passed
over (the longer side cut to the shorter's length and :data:`EDITS` more).
The work grows with the length, and with the keys passed over times at most
:data:`EDITS` where the traces part, not with the product of the lengths
(difflib's longest common blocks over whole traces, which this replaces,
took 281 s for 32,001 ops with one extra in the middle). Pairs are always of
equal keys and in order; where a key could pair two ways (a layer called
twice in B), the earlier one pairs.
"""

from __future__ import annotations

import difflib
from typing import Final

import numpy as np

__all__ = ["EDITS", "GAP_CELLS", "RUN", "Matcher", "match", "spans"]

EDITS: Final = 64
"""The most keys passed over, on both sides together, that the search for the way back in
step tries before jumping to the nearest run of :data:`RUN` equal keys."""
RUN: Final = 8
"""Equal keys in a row that put two sequences back in step."""
GAP_CELLS: Final = 1 << 16
"""The largest region passed over by a jump (its lengths' product) still matched."""
_FIRST_BLOCK: Final = 16


class Matcher:
    """One :func:`match`: the two key sequences, the runs of pairs found so far, and
    ``compared``, the keys compared (the work done, which the tests bound)."""

    def __init__(self, a: np.ndarray, b: np.ndarray) -> None:
        self.a, self.b = a, b
        self.list_a, self.list_b = a.tolist(), b.tolist()
        self.n, self.m = len(a), len(b)
        self.runs: list[tuple[int, int, int]] = []
        self.compared = 0
        self._hashes: tuple[np.ndarray, np.ndarray] | None = None

    def common(self, i: int, j: int) -> int:
        """How many keys from ``a[i]`` and ``b[j]`` on are equal in a row."""
        return self._equal(self.a[i : self.n], self.b[j : self.m])

    def common_to_end(self, i: int, j: int) -> int:
        """How many keys up to the ends (past ``a[i]`` and ``b[j]``) are equal in a row."""
        return self._equal(self.a[i : self.n][::-1], self.b[j : self.m][::-1])

    def _equal(self, a: np.ndarray, b: np.ndarray) -> int:
        limit = min(len(a), len(b))
        done, block = 0, _FIRST_BLOCK
        while done < limit:
            end = min(limit, done + block)
            self.compared += end - done
            differ = np.flatnonzero(a[done:end] != b[done:end])
            if len(differ):
                return done + int(differ[0])
            done, block = end, block * 4
        return done

    def back_in_step(self, i: int, j: int, cap: int) -> tuple[int, int] | None:
        """Myers' search from ``(i, j)``, at most ``cap`` keys passed over: the first place
        (fewest passed over) where :data:`RUN` equal keys follow, or the ends of both
        sequences. The equal keys met on the way are paired."""
        a, b, n, m = self.list_a, self.list_b, self.n - i, self.m - j
        # Per number of keys passed over, per diagonal k = x - y: (diagonal it came from,
        # x where its equal keys start, x where they end), x and y counted from (i, j).
        history: list[dict[int, tuple[int, int, int]]] = []
        for edits in range(cap + 1):
            before = history[-1] if history else {}
            here: dict[int, tuple[int, int, int]] = {}
            for k in range(-edits, edits + 1, 2):
                if not edits:
                    source, x = 0, 0
                else:
                    source, x = k, -1
                    if k + 1 in before and before[k + 1][2] - k <= m:  # pass over b[y]
                        source, x = k + 1, before[k + 1][2]
                    if k - 1 in before and x < before[k - 1][2] + 1 <= n:  # pass over a[x]
                        source, x = k - 1, before[k - 1][2] + 1
                    if x < 0:
                        continue
                end, limit = x, min(n - x, m - x + k, RUN)
                while end - x < limit and a[i + end] == b[j + end - k]:
                    end += 1
                self.compared += end - x + 1
                here[k] = (source, x, end)
                if end - x >= RUN or (end == n and end - k == m):
                    self._keep_path(history, edits, source, i, j)
                    return i + x, j + x - k
            history.append(here)
        return None

    def _keep_path(
        self, history: list[dict[int, tuple[int, int, int]]], edits: int, k: int, i: int, j: int
    ) -> None:
        kept = []
        for level in range(edits - 1, -1, -1):
            source, start, end = history[level][k]
            if end > start:
                kept.append((i + start, j + start - k, end - start))
            k = source
        self.runs.extend(reversed(kept))

    def hashes(self) -> tuple[np.ndarray, np.ndarray]:
        """A 64-bit hash of every run of :data:`RUN` keys starting in A and in B."""
        if self._hashes is None:
            hashed = []
            for codes in (self.a, self.b):
                count = max(len(codes) - RUN + 1, 0)
                mixed = _mix(codes)
                total = np.zeros(count, dtype=np.uint64)
                for offset in range(RUN if count else 0):
                    # Wraps modulo 2**64 on purpose; every hit is checked key by key.
                    total = total * np.uint64(1_000_003) + mixed[offset : offset + count]
                hashed.append(total)
            self._hashes = (hashed[0], hashed[1])
        return self._hashes

    def nearest_run(self, i: int, j: int) -> tuple[int, int] | None:
        """The ``(p, q)`` with the least ``(p - i) + (q - j)`` where :data:`RUN` equal keys
        start, searched in windows growing from ``(i, j)``."""
        hash_a, hash_b = self.hashes()
        width = 2 * RUN
        while True:
            window_a, window_b = hash_a[i : i + width], hash_b[j : j + width]
            self.compared += len(window_a) + len(window_b)
            if not len(window_a) or not len(window_b):
                return None
            known, first = np.unique(window_a, return_index=True)
            where = np.minimum(np.searchsorted(known, window_b), len(known) - 1)
            qs = np.flatnonzero(known[where] == window_b)
            ps = first[where[qs]]
            whole = i + width >= len(hash_a) and j + width >= len(hash_b)
            for t in np.argsort(ps + qs, kind="stable"):
                p, q = i + int(ps[t]), j + int(qs[t])
                if int(ps[t] + qs[t]) > width and not whole:
                    break  # a nearer run may start past this window
                if self.list_a[p : p + RUN] == self.list_b[q : q + RUN]:
                    return p, q
            if whole:
                return None
            width *= 4

    def disjoint(self, i: int, p: int, j: int, q: int) -> bool:
        """Whether no key of ``a[i:p]`` is in ``b[j:q]``."""
        self.compared += min(p, self.n) - i + min(q, self.m) - j
        return set(self.list_a[i : min(p, self.n)]).isdisjoint(self.list_b[j : min(q, self.m)])

    def pass_over(self, i: int, p: int, j: int, q: int) -> None:
        """Pair what can be paired in ``a[i:p]`` and ``b[j:q]``, a region the search gave up on."""
        if (p - i) * (q - j) > GAP_CELLS or p == i or q == j:
            return
        self.compared += (p - i) * (q - j)
        matcher = difflib.SequenceMatcher(None, self.list_a[i:p], self.list_b[j:q], autojunk=False)
        for block in matcher.get_matching_blocks():
            if block.size:
                self.runs.append((i + block.a, j + block.b, block.size))

    def pairs(self) -> tuple[np.ndarray, np.ndarray]:
        """Walk both sequences once: the indices into A and B of each pair."""
        i = j = 0
        ending: tuple[int, int, int] | None = None
        while i < self.n and j < self.m:
            equal = self.common(i, j)
            if equal:
                self.runs.append((i, j, equal))
                i, j = i + equal, j + equal
                continue
            left = (self.n - i) + (self.m - j)
            near = None if left <= EDITS else self.nearest_run(i, j)
            if near is None and ending is None:
                # No run of RUN equal keys is left: the ends are the next place in step (a
                # module's last op after other kernels' ops, fused or not, is its last op).
                ending = (self.n, self.m, self.common_to_end(i, j))
                self.n, self.m = self.n - ending[2], self.m - ending[2]
                continue
            # The nearest run bounds the search. Where no key is on both sides within that
            # many keys (a fused kernel's ops and the one), no path can pair any before it.
            cap = min(left if near is None else (near[0] - i) + (near[1] - j), EDITS)
            resumed = None
            if not self.disjoint(i, i + cap, j, j + cap):
                resumed = self.back_in_step(i, j, cap)
            if resumed is not None:
                i, j = resumed
                continue
            if near is not None:
                p, q = near
            else:  # no run of RUN equal keys is left: what is left of the shorter side
                p = min(self.n, i + (self.m - j) + EDITS)  # pairs within EDITS of it, if at all
                q = min(self.m, j + (self.n - i) + EDITS)
            self.pass_over(i, p, j, q)
            i, j = p, q
        if ending is not None and ending[2]:
            self.runs.append((ending[0] - ending[2], ending[1] - ending[2], ending[2]))
        if not self.runs:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        starts_a, starts_b, sizes = (np.array(column, np.int64) for column in zip(*self.runs))
        return spans(starts_a, sizes), spans(starts_b, sizes)


def _mix(codes: np.ndarray) -> np.ndarray:
    """Each key scrambled into 64 bits (splitmix64's finaliser): any int64 key, however
    large or negative (a name and shape joined are past 2**31), with no table sized by it."""
    mixed = codes.astype(np.int64).view(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    mixed = (mixed ^ (mixed >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    mixed = (mixed ^ (mixed >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    result: np.ndarray = mixed ^ (mixed >> np.uint64(31))
    return result


def match(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pair equal keys of two integer sequences in order: the indices into ``a`` and ``b``
    of each pair, both increasing."""
    return Matcher(np.asarray(a, np.int64), np.asarray(b, np.int64)).pairs()


def spans(starts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """``starts[0], starts[0] + 1, ..., starts[0] + sizes[0] - 1, starts[1], ...``."""
    offsets = np.arange(int(sizes.sum())) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    spans: np.ndarray = np.repeat(starts, sizes) + offsets
    return spans
