"""A segment's per-token columns as Redis holds them: each one packed into machine numbers (array's types,
little-endian), so a turn appends its tokens' bytes at the column's end and a load reads a column in one C call,
never JSON of the whole history.

`Tail` is a column a turn holds only the end of: a turn appends masks, logprobs and versions and reads back only its
own, so the store leaves the rest in Redis (rollout_farm/services/episodes/session_store.py loads a whole session
for a retry or the trajectory).
"""

from __future__ import annotations

import sys
from array import array

COLUMNS = {  # Segment's field -> its array type: int32 ids, int8 mask, float64 logprobs (as exact as JSON's), int64
    "token_ids": "i",
    "loss_mask": "b",
    "logprobs": "d",
    "sampling_logprobs": "d",
    "token_versions": "q",
}
SIZES = {name: array(code).itemsize for name, code in COLUMNS.items()}


def pack(name: str, values) -> bytes:
    packed = array(COLUMNS[name], values)
    if sys.byteorder == "big":  # stored little-endian whatever the ingress's machine
        packed.byteswap()
    return packed.tobytes()


def unpack(name: str, data: bytes) -> list:
    values = array(COLUMNS[name])
    values.frombytes(data)
    if sys.byteorder == "big":
        values.byteswap()
    return values.tolist()


class Tail:
    """A column of which only the entries from `start` on are in memory. It appends, and reads what it holds; a slice
    from 0 that ends within what it does not hold is such a column too (a fork's copy of its parent's prefix, which
    Redis keeps in the parent); any other read of an entry it does not hold is a LookupError (a bug: load it)."""

    def __init__(self, start: int, items: list | None = None):
        self.start, self.items = start, items if items is not None else []

    def __len__(self) -> int:
        return self.start + len(self.items)

    def __iadd__(self, more) -> Tail:
        self.items.extend(more)
        return self

    def __getitem__(self, k):
        if not isinstance(k, slice):
            i = k + len(self) if k < 0 else k
            return self.items[self.held(i, i + 1).start]
        lo, hi, step = k.indices(len(self))
        if lo == 0 and hi <= self.start and step == 1:
            return Tail(hi)
        return self.items[self.held(lo, hi)][::step] if hi > lo else []

    def held(self, lo: int, hi: int) -> slice:
        if lo < self.start:
            raise LookupError(f"entries {lo}..{hi} of a column held from {self.start} on: load the whole session")
        return slice(lo - self.start, hi - self.start)

    def __repr__(self) -> str:
        return f"Tail({self.start}, {self.items!r})"
