"""A simulated engine instance: paged KV cache with prefix caching and LRU eviction, continuous batching with chunked
prefill, one event per engine iteration.

Modelled after vLLM V1 (``vllm/v1/core/sched/scheduler.py``, ``vllm/v1/core/block_pool.py``,
``vllm/v1/core/kv_cache_manager.py``):

* **KV cache**: ``num_blocks`` blocks of ``block_size`` tokens. A full prompt block, once computed, is registered
  under its block hash (BlockStored event); blocks whose reference count drops to 0 stay cached and enter an LRU
  queue, evicted oldest-first (BlockRemoved event) when a new allocation needs room. A request frees its blocks tail
  first, so the deepest blocks of a prefix are evicted before its root (as vLLM's free queue does).
* **Prefix hits**: at admission the request's leading block hashes present in the cache are reused; as in vLLM at
  least one prompt token is always computed (a full hit recomputes the last block).
* **Scheduling** per iteration (token budget ``max_num_batched_tokens``, at most ``max_num_seqs`` running): every
  decoding sequence gets one token, then running partial prefills get chunks, then waiting requests are admitted
  FCFS while blocks and budget last (head-of-line blocking, no skipping).
* **Memory simplification**: a request reserves the blocks for its prompt and all its output tokens at admission
  (no preemption/recompute), so decode iterations need no per-token block work.
* **Decode in O(1) per iteration**: the batch is summarised by its size B and total context S; each sequence's
  finishing iteration number is known when it starts decoding (a heap), so an iteration costs O(1) plus O(finished).

Instances do no routing; :mod:`dlmix.sim.simulator` drives them and owns the clock.
"""
from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from typing import Callable, Deque, List, Optional

# request kinds on an instance
FULL = 0        # aggregated: prefill here, then decode here
PREFILL = 1     # PD prefill leg: prefill here, then transfer the KV
RECV = 2        # PD decode leg: KV arrives over the link, decode here


class KVCache:
    """Paged KV cache with prefix caching and LRU eviction.

    Args:
        num_blocks: capacity, blocks. block_size: tokens per block.
        on_store / on_remove: callbacks ``(keys: list[int])`` for BlockStored / BlockRemoved events (may be None).

    Block accounting: ``free`` anonymous blocks + ``len(lru)`` cached blocks with no holder are allocatable;
    ``ref[key]`` counts holders of a cached (hashed) block.
    """

    __slots__ = ("num_blocks", "block_size", "free", "ref", "lru", "on_store", "on_remove", "evicted")

    def __init__(self, num_blocks: int, block_size: int, on_store: Optional[Callable] = None,
                 on_remove: Optional[Callable] = None):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = int(num_blocks)
        self.block_size = int(block_size)
        self.free = self.num_blocks
        self.ref: dict = {}
        self.lru: "OrderedDict[int, None]" = OrderedDict()
        self.on_store = on_store
        self.on_remove = on_remove
        self.evicted = 0

    def used(self) -> int:
        """Blocks held by requests (not allocatable)."""
        return self.num_blocks - self.free - len(self.lru)

    def usage(self) -> float:
        """Fraction of blocks held by requests, in [0, 1]."""
        return self.used() / self.num_blocks

    def match(self, keys) -> int:
        """Number of leading ``keys`` resident in the cache (held or evictable)."""
        ref = self.ref
        n = 0
        for k in keys:
            if k in ref:
                n += 1
            else:
                break
        return n

    def try_admit(self, keys, n_hit: int, n_anon: int) -> bool:
        """Pin the first ``n_hit`` keys (all resident) and allocate ``n_anon`` anonymous blocks, evicting LRU cached
        blocks if needed. Returns False, changing nothing, if there is not enough room."""
        lru = self.lru
        pinned_from_lru = 0
        for k in keys[:n_hit]:
            if k in lru:
                pinned_from_lru += 1
        if n_anon > self.free + len(lru) - pinned_from_lru:
            return False
        ref = self.ref
        for k in keys[:n_hit]:
            r = ref[k]
            if r == 0:
                del lru[k]
            ref[k] = r + 1
        take = min(n_anon, self.free)
        self.free -= take
        rest = n_anon - take
        if rest:
            gone = []
            for _ in range(rest):
                k, _v = lru.popitem(last=False)
                del ref[k]
                gone.append(k)
            self.evicted += rest
            if self.on_remove is not None:
                self.on_remove(gone)
        return True

    def register(self, keys) -> int:
        """The computed (or received) full blocks ``keys`` get their hashes: each converts one anonymous block of the
        caller. A key already cached (another request computed it first) is shared instead and the caller's block
        is returned to the free pool. Emits BlockStored for newly cached keys. Returns the number of anonymous
        blocks consumed (= len(keys))."""
        ref = self.ref
        lru = self.lru
        new = []
        for k in keys:
            r = ref.get(k)
            if r is None:
                ref[k] = 1
                new.append(k)
            else:
                if r == 0:
                    del lru[k]
                ref[k] = r + 1
                self.free += 1
        if new and self.on_store is not None:
            self.on_store(new)
        return len(keys)

    def release(self, keys, n_anon: int) -> None:
        """A request frees its hashed blocks ``keys`` (tail first into the LRU) and ``n_anon`` anonymous blocks."""
        ref = self.ref
        lru = self.lru
        for k in reversed(keys):
            r = ref[k] - 1
            ref[k] = r
            if r == 0:
                lru[k] = None
        self.free += n_anon

    def clear(self) -> None:
        """Drop every cached block with no holder (AllBlocksCleared-like for the evictable part)."""
        if self.lru:
            gone = list(self.lru)
            for k in gone:
                del self.ref[k]
            self.free += len(gone)
            self.lru.clear()
            if self.on_remove is not None:
                self.on_remove(gone)


class Seq:
    """A request's state on one instance."""

    __slots__ = ("req", "kind", "keys", "n", "out", "done", "held", "anon", "hit", "dest", "state", "enq_time",
                 "sid")

    def __init__(self, req, kind: int, keys, n: int, out: int, dest=None):
        self.req = req          # simulator-side record (dlmix.sim.simulator.ReqRecord)
        self.kind = kind
        self.keys = keys        # full prompt block keys at this instance's block size
        self.n = n              # prompt tokens
        self.out = out          # output tokens produced on this instance (PREFILL: 0)
        self.done = 0           # prompt tokens computed (incl. prefix hits)
        self.held = 0           # leading keys held as hashed blocks
        self.anon = 0           # anonymous blocks held
        self.hit = 0            # prefix-hit tokens at admission
        self.dest = dest        # PD: decode instance
        self.state = 0
        self.enq_time = 0.0
        self.sid = 0


class SimInstance:
    """One engine instance.

    Args:
        idx: index (== router slot). spec: :class:`dlmix.sim.config.InstanceSpec`. timing: object with
        ``iteration(t_prefill, quad, prefill_end_sum, batch, sum_ctx) -> seconds`` and ``r0``.
        num_blocks: KV capacity, blocks. on_store / on_remove: KV event callbacks ``(slot, keys)``.
    """

    def __init__(self, idx: int, spec, timing, num_blocks: int, on_store=None, on_remove=None):
        self.idx = idx
        self.spec = spec
        self.id = spec.id
        self.role = spec.role
        self.timing = timing
        self.bs = spec.block_size
        self.budget = spec.max_num_batched_tokens
        self.max_seqs = spec.max_num_seqs
        self.kv = KVCache(num_blocks, self.bs,
                          (lambda keys, s=idx: on_store(s, keys)) if on_store else None,
                          (lambda keys, s=idx: on_remove(s, keys)) if on_remove else None)
        self.waiting: Deque[Seq] = deque()
        self.prefilling: List[Seq] = []
        self.dec_heap: list = []      # (finish_step, sid, seq)
        self.B = 0                    # decoding sequences
        self.S = 0                    # their total context, tokens
        self.step_no = 0              # iterations completed
        self.busy = False             # an iteration is in flight
        self.busy_time = 0.0
        # the simulator's clock bookkeeping for this instance (dlmix.sim.simulator)
        self.link_free = 0.0          # time the egress link's FIFO drains, s
        self.step_start = 0.0         # start of the iteration (or decode span) in flight, s
        self.step_end = 0.0           # its end, s
        self.version = 0              # bumped when a span is truncated (stale STEP events are skipped)
        self.kick_pending = False     # a KICK event is queued for this instant
        self.itl_idx = -1             # index of the in-flight step in the simulator's ITL samples (-1: none)
        self.queued_prefill_tokens = 0  # uncomputed prompt tokens of waiting + prefilling sequences (true state)
        self._sid = 0
        # per-iteration plan, filled by plan_step
        self._chunks: List[tuple] = []
        self._first: List[Seq] = []
        self._rejected: List[Seq] = []
        self._batch = 0
        self._k = 1
        self._dt = 0.0
        self.fast_forward = True      # collapse decode-only iterations into spans
        # stats
        self.n_steps = 0
        self.prefill_tokens = 0
        self.hit_tokens = 0
        self.prompt_tokens = 0
        self.decode_tokens = 0
        self.requests = 0

    # ---- queueing -------------------------------------------------------------------------------------------
    def enqueue(self, seq: Seq, now: float) -> None:
        """Add a sequence to the waiting queue (FCFS)."""
        self._sid += 1
        seq.sid = self._sid
        seq.enq_time = now
        self.waiting.append(seq)
        if seq.kind != RECV:
            self.queued_prefill_tokens += seq.n
        self.requests += 1

    def has_work(self) -> bool:
        """True if anything is waiting, prefilling or decoding."""
        return bool(self.waiting or self.prefilling or self.B)

    def running(self) -> int:
        """Running sequences (prefilling + decoding)."""
        return len(self.prefilling) + self.B

    def blocks_needed(self, seq: Seq) -> int:
        """Blocks a sequence holds while on this instance: prompt plus its output tokens here."""
        return -(-(seq.n + seq.out) // self.bs)

    # ---- one iteration --------------------------------------------------------------------------------------
    def plan_step(self) -> float:
        """Schedule the next iteration (admissions happen here) and return its duration in seconds (0.0 if there is
        nothing to run). Must be followed by :meth:`finish_step`."""
        budget = self.budget - self.B
        chunks = self._chunks = []
        first = self._first = []
        t_p = 0
        quad = 0.0
        end_sum = 0
        for s in self.prefilling:
            if budget <= 0:
                break
            c = min(s.n - s.done, budget)
            chunks.append((s, c))
            budget -= c
            t_p += c
            quad += (s.done + c) ** 2 - s.done ** 2
            end_sum += s.done + c
        n_run = self.running()
        kv = self.kv
        bs = self.bs
        batch_extra = 0
        while self.waiting and n_run < self.max_seqs:
            s = self.waiting[0]
            if s.kind == RECV:
                if budget <= 0:
                    break
                m = kv.match(s.keys)
                total = self.blocks_needed(s)
                if total > kv.num_blocks:
                    self.waiting.popleft()
                    s.state = -1
                    self._rejected.append(s)
                    continue
                if not kv.try_admit(s.keys, m, total - m):
                    break
                self.waiting.popleft()
                s.held = m
                s.anon = total - m
                rest = s.keys[m:]
                kv.register(rest)
                s.held += len(rest)
                s.anon -= len(rest)
                s.done = s.n
                s.hit = m * bs
                first.append(s)
                budget -= 1
                batch_extra += 1
                n_run += 1
                continue
            if budget <= 0:
                break
            m = kv.match(s.keys)
            m = min(m, (s.n - 1) // bs)
            total = self.blocks_needed(s)
            if total > kv.num_blocks:
                self.waiting.popleft()
                self.queued_prefill_tokens -= s.n
                s.state = -1
                self._rejected.append(s)
                continue
            if not kv.try_admit(s.keys, m, total - m):
                break
            self.waiting.popleft()
            s.held = m
            s.anon = total - m
            s.done = s.hit = m * bs
            self.queued_prefill_tokens -= s.hit
            self.hit_tokens += s.hit
            self.prompt_tokens += s.n
            s.req.on_admit(self, s)
            self.prefilling.append(s)
            c = min(s.n - s.done, budget)
            chunks.append((s, c))
            budget -= c
            t_p += c
            quad += (s.done + c) ** 2 - s.done ** 2
            end_sum += s.done + c
            n_run += 1
        batch = self.B + batch_extra
        if not chunks and not batch:
            return 0.0
        self._batch = batch
        self.S += sum(s.n for s in first)
        if not chunks and not first and self.fast_forward:
            # decode-only: run every iteration up to the next finishing sequence as one span (closed-form time);
            # an arrival in between truncates the span at the next iteration boundary (truncate()).
            k = max(self.dec_heap[0][0] - self.step_no, 1)
            dt = self.timing.decode_cum(batch, self.S, k)
            self._k = k
        else:
            dt = self.timing.iteration(t_p, quad, end_sum, batch, self.S)
            self._k = 1
        self._dt = dt
        self.n_steps += self._k
        self.busy_time += dt
        self.prefill_tokens += t_p
        self.decode_tokens += batch * self._k
        return dt

    def truncate(self, elapsed: float) -> float:
        """Cut a decode-only span (see :meth:`plan_step`) after the iteration in progress ``elapsed`` seconds into
        it. Returns the new span duration (unchanged if the span has one iteration or already ends there)."""
        k = self._k
        if k <= 1:
            return self._dt
        cum = self.timing.decode_cum
        B, S = self._batch, self.S
        lo, hi = 1, k  # smallest j with cum(j) >= elapsed
        while lo < hi:
            mid = (lo + hi) // 2
            if cum(B, S, mid) >= elapsed - 1e-12:
                hi = mid
            else:
                lo = mid + 1
        if lo >= k:
            return self._dt
        new = cum(B, S, lo)
        self.n_steps -= k - lo
        self.decode_tokens -= B * (k - lo)
        self.busy_time -= self._dt - new
        self._k = lo
        self._dt = new
        return new

    def finish_step(self):
        """Apply the planned iteration. Returns ``(prefilled, firsts, finished)``: sequences whose prefill completed
        (their first token for FULL, KV ready for PREFILL), RECV sequences that produced their first token, and
        sequences that finished decoding (all lists)."""
        k = self._k
        self.step_no += k
        j = self.step_no
        bs = self.bs
        kv = self.kv
        prefilled = []
        for s, c in self._chunks:
            s.done += c
            self.queued_prefill_tokens -= c
            full = min(s.done // bs, len(s.keys))
            if full > s.held:
                new = s.keys[s.held:full]
                kv.register(new)
                s.held = full
                s.anon -= len(new)
            if s.done >= s.n:
                prefilled.append(s)
        if prefilled:
            done_set = set(id(s) for s in prefilled)
            self.prefilling = [s for s in self.prefilling if id(s) not in done_set]
        # decode: every decoding sequence produced one token in each of the k iterations
        self.S += self.B * k
        firsts = self._first
        heap = self.dec_heap
        for s in firsts:   # RECV joined this iteration: produced its first token
            self.B += 1
            self.S += 1
            heapq.heappush(heap, (j + s.out - 1, s.sid, s))
        finished = []
        while heap and heap[0][0] <= j:
            _, _, s = heapq.heappop(heap)
            self.B -= 1
            self.S -= s.n + s.out
            finished.append(s)
        for s in prefilled:
            if s.kind == FULL:
                if s.out <= 1:
                    finished.append(s)
                else:
                    self.B += 1
                    self.S += s.n + 1
                    heapq.heappush(heap, (j + s.out - 1, s.sid, s))
        for s in finished:
            kv.release(s.keys[:s.held], s.anon)
            s.held = s.anon = 0
        self._chunks = []
        self._first = []
        return prefilled, firsts, finished

    def release(self, s: Seq) -> None:
        """Free a PREFILL sequence's blocks (after its KV was sent)."""
        self.kv.release(s.keys[:s.held], s.anon)
        s.held = s.anon = 0

    def take_rejected(self) -> List[Seq]:
        """Sequences that can never fit in this instance's KV cache (dropped from the queue)."""
        r = self._rejected
        self._rejected = []
        return r
