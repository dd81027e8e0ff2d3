"""Size bucketing of named tensors, shared by the weight export (opid_mega.megatron.weights) and the rollout
engines' weight updates (opid_mega.rollout): neither layer imports the other."""
from __future__ import annotations

from typing import Iterable, Iterator


def size_buckets(items: Iterable, bucket_bytes: int) -> Iterator[list]:
    """Lists of (name, tensor) of about `bucket_bytes` each: a list closes as soon as its tensors reach the size.
    `items` yields (name, tensor) pairs, or ready lists of pairs, which pass through as buckets of their own (the
    open bucket is closed first, so the order is kept)."""
    bucket, size = [], 0
    for item in items:
        if isinstance(item, list):
            if bucket:
                yield bucket
                bucket, size = [], 0
            yield item
            continue
        bucket.append(item)
        size += item[1].numel() * item[1].element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket
