"""Plain, I/O-free state the routing policies operate on.

These types are shared by the live router (:mod:`dlmix.router.server`) and the simulator (``dlmix.sim``): a policy
sees only :class:`InstanceState` objects, a :class:`RouteRequest`, and a prefix-hit lookup, and returns a
:class:`Decision`. Nothing here opens a socket, reads a clock, or logs.

Units: tokens are token counts, times are seconds, bandwidths bytes/second, sizes bytes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, Tuple

ROLES = ("prefill", "decode", "both")


@dataclass
class InstanceLoad:
    """Load of one engine instance.

    Two sources are merged: counters the router keeps itself (updated at dispatch/completion, always fresh) and the
    figures the engine reports in its heartbeat (``waiting``, ``running``, ``kv_usage``; possibly a second old).

    Attributes:
        inflight: requests the router has sent to this instance and not seen finish (any leg).
        inflight_prefill_tokens: uncached prompt tokens the router has sent for prefill and whose prefill has not
            finished yet (tokens); the policy's prefill-queue term.
        inflight_prefill_sq: Σ (N² − h²) over those prefills (tokens², N = prompt tokens, h = prefix hit): the
            attention part of the queued work, whose FLOPs grow with the square of the prompt length.
        inflight_decode: decoding requests (router-counted) -- the decode batch size B.
        decode_ctx_tokens: sum of context lengths of those decoding requests (tokens), Σctx of the decode step.
        waiting: engine-reported waiting requests (heartbeat), 0 if unknown.
        running: engine-reported running requests (heartbeat), 0 if unknown.
        kv_usage: engine-reported KV cache usage in [0, 1] (heartbeat), 0.0 if unknown.
        processed: requests ever dispatched to the instance (tie-break, as SGLang's router).
    """

    inflight: int = 0
    inflight_prefill_tokens: int = 0
    inflight_prefill_sq: int = 0
    inflight_decode: int = 0
    decode_ctx_tokens: int = 0
    waiting: int = 0
    running: int = 0
    kv_usage: float = 0.0
    processed: int = 0

    def queue_len(self) -> int:
        """Requests queued or running as best known: max of the router's own count and the engine's report."""
        return max(self.inflight, self.waiting + self.running)

    def queue_prefill(self, tokens: int, sq: int) -> None:
        """Count a prefill of ``tokens`` uncached tokens and ``sq`` = N² − h² (tokens²) as queued here."""
        self.inflight_prefill_tokens += tokens
        self.inflight_prefill_sq += sq

    def unqueue_prefill(self, tokens: int, sq: int) -> None:
        """Remove a prefill counted by :meth:`queue_prefill` (finished, failed or moved); never below 0."""
        self.inflight_prefill_tokens = max(self.inflight_prefill_tokens - tokens, 0)
        self.inflight_prefill_sq = max(self.inflight_prefill_sq - sq, 0)

    def add_request(self) -> None:
        """A request (or a request's leg) was sent here: one more in flight, one more ever processed."""
        self.inflight += 1
        self.processed += 1

    def drop_request(self) -> None:
        """A request (or leg) counted by :meth:`add_request` left (finished, failed or moved); never below 0."""
        self.inflight = max(self.inflight - 1, 0)

    def start_decode(self, ctx: int) -> None:
        """A request of ``ctx`` context tokens joined the decode batch (B += 1, Σctx += ctx)."""
        self.inflight_decode += 1
        self.decode_ctx_tokens += ctx

    def stop_decode(self, ctx: int) -> None:
        """A request counted by :meth:`start_decode` left the decode batch; never below 0."""
        self.inflight_decode = max(self.inflight_decode - 1, 0)
        self.decode_ctx_tokens = max(self.decode_ctx_tokens - ctx, 0)


@dataclass
class InstanceState:
    """One engine instance as the router and the policies see it.

    Attributes:
        id: unique name (defaults to the URL).
        url: base URL, e.g. ``http://10.0.0.5:8000`` (no trailing slash).
        engine: engine adapter name (``vllm``).
        role: ``prefill``, ``decode`` or ``both``.
        model: served model name(s) as the engine reports them in ``/v1/models``; the first is the primary.
        cluster: cluster name (free text; cross-cluster mode balances across clusters of different chips).
        chip: chip profile name in the catalog (:mod:`dlmix.hw.profiles`), e.g. ``H100``; ``cpu-x86`` default.
        num_chips: chips the instance spans (TP*PP); scales the cost model linearly.
        block_size: engine KV block size in tokens (vLLM ``--block-size``), used for block hashes.
        kv_layout: KV layout descriptor as a plain dict (``dlmix.kv.layout`` format when available).
        transport: transport descriptor dict, e.g. ``{"name": "nixl", "bandwidth_gbps": 100, "setup_ms": 1}``.
        kv_events: ZMQ endpoint of the engine's KV events publisher (``tcp://host:port``) or None.
        api_key: bearer key the router presents to this backend, or None.
        healthy: passes health checks / heartbeats and its circuit breaker is closed.
        draining: admin-drained: takes no new requests, finishes the running ones.
        slot: small integer the prefix index uses as this instance's bit (assigned by the registry).
        load: :class:`InstanceLoad`.
        ttft_ratio / itl_ratio: online calibration, EWMA of measured/predicted TTFT and ITL (1.0 = model exact).
        extra: free-form metadata (e.g. the engine's registration payload).
    """

    id: str
    url: str
    engine: str = "vllm"
    role: str = "both"
    model: Sequence[str] = ()
    cluster: str = "default"
    chip: str = "cpu-x86"
    num_chips: int = 1
    block_size: int = 16
    kv_layout: Optional[dict] = None
    transport: Optional[dict] = None
    kv_events: Optional[str] = None
    api_key: Optional[str] = None
    healthy: bool = True
    draining: bool = False
    slot: int = -1
    load: InstanceLoad = field(default_factory=InstanceLoad)
    ttft_ratio: float = 1.0
    itl_ratio: float = 1.0
    extra: dict = field(default_factory=dict)

    def __repr__(self) -> str:
        return f"InstanceState({self.id!r}, role={self.role}, chip={self.chip}, healthy={self.healthy})"

    def serves(self, model: Optional[str]) -> bool:
        """True if ``model`` is None/empty (any) or one of this instance's served model names."""
        return not model or not self.model or model in self.model

    def can_prefill(self) -> bool:
        """Role allows prefill legs (``prefill`` or ``both``)."""
        return self.role in ("prefill", "both")

    def can_decode(self) -> bool:
        """Role allows decode legs or whole requests (``decode`` or ``both``)."""
        return self.role in ("decode", "both")

    def available(self) -> bool:
        """Healthy and not draining."""
        return self.healthy and not self.draining


@dataclass
class RouteRequest:
    """What a policy knows about one request.

    Attributes:
        model: requested model name (may be None).
        prompt_len: prompt length in tokens (exact with a tokenizer, estimated as chars/4 otherwise).
        max_tokens: requested output tokens (None = unknown; the cost model then uses ``default_output_tokens``).
        stream: whether the client streams.
        block_hashes: callable ``block_size -> list[int]`` giving the request's chained block hashes (64-bit ints) for
            an engine block size; cached by the caller. Empty list when no prompt text could be extracted.
        key: affinity key (optional), e.g. a session id.
        prefill_id / decode_id: instance ids the request is pinned to (None: any); the router sets them from the
            ``x-dlmix-prefill-instance`` / ``x-dlmix-decode-instance`` headers when ``allow_pinning`` is on, and
            :class:`~dlmix.routing.policies.base.ClusterView` offers only that instance as the candidate.
    """

    model: Optional[str] = None
    prompt_len: int = 0
    max_tokens: Optional[int] = None
    stream: bool = False
    block_hashes: Callable[[int], Sequence[int]] = field(default=lambda bs: ())
    key: Optional[str] = None
    prefill_id: Optional[str] = None
    decode_id: Optional[str] = None


@dataclass
class Decision:
    """A policy's placement.

    Attributes:
        decode: instance that produces the answer (whole request when ``prefill`` is None).
        prefill: instance that runs the prefill leg (PD disaggregation) or None (no disaggregation).
        predicted_ttft: the policy's TTFT estimate in seconds, if it made one (else None).
        hit_tokens: prefix-hit tokens expected on the instance that prefills.
        reason: short machine-readable reason, e.g. ``"local:short"``, ``"pd"``, ``"rr"``; goes to metrics labels.
        prefill_failure: why the last prefill leg failed when the router moved the prefill to the decode instance
            (``""`` otherwise); the router names it when that decode instance cannot prefill itself.

    Load bookkeeping (the router and the simulator call these, in this order, for every dispatched request; they
    update the router-side counters of :class:`InstanceLoad`)::

        decision.begin(req)            # dispatched: counted in flight, its prefill queued where it prefills
        decision.prefill_done(req)     # prefill finished: out of the prefill queue, into D's decode batch
        decision.end(req)              # finished or failed (prefilled=False when prefill_done never ran)
    """

    decode: InstanceState
    prefill: Optional[InstanceState] = None
    predicted_ttft: Optional[float] = None
    hit_tokens: int = 0
    reason: str = ""
    prefill_failure: str = ""

    def prefill_work(self, req: "RouteRequest") -> Tuple[int, int]:
        """``(uncached tokens, N² − h²)`` of the request's prefill (N = ``req.prompt_len`` tokens, h = this
        decision's prefix hit, capped at N): the prefill-queue figures :class:`InstanceLoad` counts."""
        n = req.prompt_len
        h = min(self.hit_tokens, n)
        return n - h, n * n - h * h

    def _prefiller(self) -> InstanceLoad:
        return (self.prefill if self.prefill is not None else self.decode).load

    def begin(self, req: "RouteRequest") -> None:
        """Count the dispatched request in the instances' load: in flight on D (and on P for PD), its prefill work
        queued on the instance that prefills."""
        self.decode.load.add_request()
        if self.prefill is not None:
            self.prefill.load.add_request()
        self._prefiller().queue_prefill(*self.prefill_work(req))

    def prefill_done(self, req: "RouteRequest") -> None:
        """The prefill finished (prefill leg returned, or first token of a local prefill): the request leaves the
        prefill queue (and P's in-flight count for PD) and joins D's decode batch with ``prompt_len`` context."""
        if self.prefill is not None:
            self.prefill.load.drop_request()
        self._prefiller().unqueue_prefill(*self.prefill_work(req))
        self.decode.load.start_decode(req.prompt_len)

    def end(self, req: "RouteRequest", prefilled: bool = True) -> None:
        """The request finished (or failed). ``prefilled`` says whether :meth:`prefill_done` ran for it (if not,
        its prefill is taken off the queue and P's in-flight count here)."""
        self.decode.load.drop_request()
        if prefilled:
            self.decode.load.stop_decode(req.prompt_len)
            return
        if self.prefill is not None:
            self.prefill.load.drop_request()
        self._prefiller().unqueue_prefill(*self.prefill_work(req))


class NoInstanceError(Exception):
    """No healthy instance can serve the request (the router answers 503)."""

    @classmethod
    def for_request(cls, req: "RouteRequest") -> "NoInstanceError":
        """The error for ``req``, naming its model when the request names one."""
        return cls("no available instance" + (f" for model {req.model!r}" if req.model else ""))


class OverloadedError(NoInstanceError):
    """A policy's admission control refused the request because no plan is predicted to meet its SLO (early
    rejection, Mooncake FAST'25 §7). The router answers 503 with the message; the simulator counts the request as
    rejected (not good)."""


def prompt_len_from_hashes(req: RouteRequest, block_size: int) -> int:
    """Helper: number of tokens covered by full blocks of the request at ``block_size`` (tokens)."""
    return len(req.block_hashes(block_size)) * block_size


__all__ = [
    "ROLES",
    "InstanceLoad",
    "InstanceState",
    "RouteRequest",
    "Decision",
    "NoInstanceError",
    "OverloadedError",
    "prompt_len_from_hashes",
]
