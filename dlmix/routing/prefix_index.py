"""Global prefix index: block hash (64-bit int) → set of instances holding that block, as a bitmask.

Memory: one dict entry per distinct block (key int + small-int bitmask; masks of up to 8 instances are interned
small ints). Measured by ``benchmarks/router.py`` (``index_mib_per_million_blocks``). Instances are identified by
their ``slot`` (0..N), assigned by the registry.

:class:`PrefixIndex` is fed by engine KV events (BlockStored / BlockRemoved / AllBlocksCleared); it is exact up to
event delay. :class:`ApproxIndex` records where the router itself sent which prefixes (no engine feedback) and evicts
least-recently-used blocks beyond a capacity, like SGLang's approximate tree / llm-d's approximate scorer.
Both are plain Python objects without I/O (the simulator uses them directly).
"""
from __future__ import annotations

from itertools import islice
from typing import Dict, Iterable, Sequence


class PrefixIndex:
    """Exact index fed by KV events. Not thread-safe (one event loop)."""

    __slots__ = ("_map",)

    def __init__(self):
        self._map: Dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._map)

    def store(self, slot: int, keys: Iterable[int]) -> None:
        """Instance ``slot`` now holds blocks ``keys`` (BlockStored)."""
        bit = 1 << slot
        m = self._map
        for k in keys:
            m[k] = m.get(k, 0) | bit

    def remove(self, slot: int, keys: Iterable[int]) -> None:
        """Instance ``slot`` evicted blocks ``keys`` (BlockRemoved); unknown keys are ignored."""
        nbit = ~(1 << slot)
        m = self._map
        for k in keys:
            v = m.get(k)
            if v is not None:
                v &= nbit
                if v:
                    m[k] = v
                else:
                    del m[k]

    def clear(self, slot: int) -> None:
        """Instance ``slot`` dropped all blocks (AllBlocksCleared, or the instance left). O(index size)."""
        bit = 1 << slot
        nbit = ~bit
        m = self._map
        for k in [k for k, v in m.items() if v & bit]:
            v = m[k] & nbit
            if v:
                m[k] = v
            else:
                del m[k]

    def match(self, keys: Sequence[int]) -> Dict[int, int]:
        """Leading consecutive blocks of ``keys`` each slot holds: ``{slot: n_blocks}`` (slots with 0 omitted)."""
        return _match(self._map, keys)


def _match(m: Dict[int, int], keys: Sequence[int]) -> Dict[int, int]:
    out: Dict[int, int] = {}
    alive = -1
    get = m.get
    for i, k in enumerate(keys):
        v = get(k, 0) & alive if alive != -1 else get(k, 0)
        gone = (alive & ~v) if alive != -1 else 0
        if gone:
            s = 0
            while gone:
                if gone & 1:
                    out[s] = i
                gone >>= 1
                s += 1
        alive = v
        if not v:
            return out
    n = len(keys)
    s = 0
    while alive > 0:
        if alive & 1:
            out[s] = n
        alive >>= 1
        s += 1
    return out


class ApproxIndex:
    """Approximate index of prefixes the router sent, with LRU eviction beyond ``capacity`` blocks.

    Args:
        capacity: maximum blocks remembered (all instances together); the oldest 1/8 are evicted when exceeded.
    """

    __slots__ = ("_map", "capacity")

    def __init__(self, capacity: int = 1 << 20):
        self._map: Dict[int, int] = {}
        self.capacity = capacity

    def __len__(self) -> int:
        return len(self._map)

    def record(self, slot: int, keys: Sequence[int]) -> None:
        """The router sent a request with block ``keys`` to ``slot``: mark them (most recently used)."""
        bit = 1 << slot
        m = self._map
        pop = m.pop
        for k in keys:
            m[k] = pop(k, 0) | bit  # re-insert → moves to the end (recency order)
        if len(m) > self.capacity:
            drop = len(m) - self.capacity + self.capacity // 8
            for k in list(islice(m, drop)):
                del m[k]

    def record_decision(self, req, decision) -> None:
        """The router dispatched ``req`` (a :class:`~dlmix.routing.state.RouteRequest`) as ``decision``: record its
        block hashes (at each instance's block size) on the decode instance and, for PD, on the prefill instance.
        Called by the live router and by the simulator at dispatch, so in-flight prefixes are known before the
        engines' KV events arrive."""
        for inst in (decision.decode, decision.prefill):
            if inst is not None:
                self.record(inst.slot, req.block_hashes(inst.block_size))

    def clear(self, slot: int) -> None:
        """Forget everything recorded for ``slot``."""
        bit = 1 << slot
        m = self._map
        for k in [k for k, v in m.items() if v & bit]:
            v = m[k] & ~bit
            if v:
                m[k] = v
            else:
                del m[k]

    def match(self, keys: Sequence[int]) -> Dict[int, int]:
        """As :meth:`PrefixIndex.match`."""
        return _match(self._map, keys)
