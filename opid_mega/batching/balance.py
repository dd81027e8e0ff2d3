"""The reference's batch order and padding, as index arrays over a batch of step-samples (pure numpy).

- `balanced_partitions(seqlens, k)`: k equal-size partitions of the step-samples with balanced token sums, by the
  largest differencing method (Karmarkar-Karp) over groups of k consecutive lengths in ascending order; each
  partition's indices ascending, partitions ordered by their token sum, largest first (ties: more items, then the
  larger (index, length) list). This is the order the reference's `balance_batch` gives the batch before it is cut
  into data-parallel shares (rank r takes partition r).
- `reference_minibatch_order(seqlens, world, mini_batch_size)`: the step-sample order under which this project's
  mini-batches (`mini_batch_size` consecutive samples of the order) hold what the reference's do: each rank takes
  its partition, and mini-batch j is the j-th slice of `mini_batch_size / world` samples of every rank's partition.
- `padding_indices(n, divisor, rng)`: the step-samples the reference duplicates (drawn without replacement) to make
  the batch a multiple of `divisor` (micro-batch x data-parallel world) before the advantage is computed.
"""
from __future__ import annotations

import heapq
from typing import Sequence

import numpy as np


class _Part:
    """One partition under construction: its (index, length) items and their token sum."""

    __slots__ = ("items", "total")

    def __init__(self, items=()):
        self.items = list(items)
        self.total = sum(v for _, v in self.items)

    def key(self):
        return (self.total, len(self.items), self.items)


class _State:
    """k partitions, kept in descending order of `_Part.key`; a heap pops the largest spread first."""

    __slots__ = ("parts",)

    def __init__(self, parts):
        self.parts = sorted(parts, key=_Part.key, reverse=True)

    def spread(self) -> int:
        return self.parts[0].total - self.parts[-1].total

    def __lt__(self, other: "_State") -> bool:
        if self.spread() != other.spread():
            return self.spread() > other.spread()
        return self.parts[0].key() > other.parts[0].key()


def balanced_partitions(seqlens: Sequence[int], k: int) -> list[list[int]]:
    """k equal-size partitions of range(len(seqlens)) with balanced sums of `seqlens` (see the module docstring)."""
    lens = [int(v) for v in seqlens]
    n = len(lens)
    if k < 1:
        raise ValueError(f"balanced_partitions: k must be >= 1, got {k}")
    if n < k or n % k:
        raise ValueError(f"balanced_partitions: {n} step-samples cannot form {k} partitions of equal size")
    ascending = sorted((v, i) for i, v in enumerate(lens))
    heap = []
    for start in range(0, n, k):
        heap.append(_State([_Part([(i, v)]) for v, i in ascending[start:start + k]]))
    heapq.heapify(heap)
    while len(heap) > 1:
        a, b = heapq.heappop(heap), heapq.heappop(heap)
        # the largest part of one state takes the smallest of the other, and so on
        merged = [_Part(a.parts[j].items + b.parts[k - 1 - j].items) for j in range(k)]
        heapq.heappush(heap, _State(merged))
    return [sorted(i for i, _ in part.items) for part in heap[0].parts]


def reference_minibatch_order(seqlens: Sequence[int], world: int, mini_batch_size: int) -> np.ndarray:
    """Step-sample order whose consecutive `mini_batch_size` slices are the reference's mini-batches after
    `balance_batch` over `world` data-parallel ranks (see the module docstring)."""
    parts = balanced_partitions(seqlens, world)
    if mini_batch_size < 1 or mini_batch_size % world:
        raise ValueError(f"reference_minibatch_order: mini_batch_size {mini_batch_size} is not a positive multiple "
                         f"of the data-parallel world {world}")
    share = mini_batch_size // world
    per_rank = len(parts[0])
    order = [i for j in range(0, per_rank, share) for part in parts for i in part[j:j + share]]
    return np.asarray(order, dtype=np.int64)


def padding_indices(n: int, divisor: int, rng: np.random.Generator) -> np.ndarray:
    """Indices of the step-samples to append as duplicates so that n becomes a multiple of `divisor`: none when it
    already is, else (-n) % divisor distinct indices drawn uniformly without replacement, in the order drawn (the
    duplicates are appended in that order)."""
    if n < 1 or divisor < 1:
        raise ValueError(f"padding_indices: need n >= 1 and divisor >= 1, got n={n}, divisor={divisor}")
    extra = (-n) % divisor
    if extra > n:
        raise ValueError(f"padding_indices: {n} step-samples cannot supply {extra} distinct duplicates "
                         f"(divisor {divisor})")
    return rng.choice(n, extra, replace=False).astype(np.int64) if extra else np.zeros(0, np.int64)
