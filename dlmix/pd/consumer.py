"""Consumer (decode) side of the pull path, engine-neutral.

Per request the engine adapter asks :func:`claim` how many tokens to load (the one per-request decision: contract
checks, pair check, prompt identity; only the tokens beyond the local prefix hit), then runs
:meth:`Consumer.pull` (usually on a worker thread) with the destination block ids, and finally
:meth:`Consumer.release` tells the producer it may free its blocks. A pull never raises: it returns a
:class:`PullResult` with ``loaded_upto`` (tokens ``[start, loaded_upto)`` are in place) and ``failed_block_ids``
(the local blocks the engine must recompute).

Pull rounds: at most ``staging_bytes`` of producer pages per round are read into the staging region (one-sided
reads under the producer's grant), converted with :func:`dlmix.kv.convert` into this engine's blocks (block size,
dtype, arrangement may differ), and before every further round an ``extend`` keeps the producer's hold alive.
A cancelled pull stops at the next round boundary, so freed destination blocks are never written.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from dlmix.kv.layout import KVLayout

from .contract import ContractError, Extend, TransferParams, Want, decode_params, encode
from .engine import plane_count, plane_page_bytes, region_names
from .pair import check_pair, layout_of

log = logging.getLogger("dlmix.pd.consumer")

__all__ = ["Claim", "PullResult", "Consumer", "claim", "failed_blocks"]


@dataclass
class Claim:
    """The consumer's decision for one request: load tokens ``[start, end)`` (``count = end - start``; 0 = load
    nothing), or ``refused`` with the reason (then the engine computes the prompt itself and the producer must be
    told ``abort``). ``params``: the decoded parameters (None when they did not decode)."""

    start: int = 0
    end: int = 0
    refused: str | None = None
    params: TransferParams | None = None

    @property
    def count(self) -> int:
        return max(0, self.end - self.start)


@dataclass
class PullResult:
    """Outcome of one pull: tokens ``[start, loaded_upto)`` are in place; ``bytes_received`` read over the
    transport in ``rounds`` rounds, ``seconds`` wall time; ``error`` None on success; ``failed_block_ids``: local
    blocks covering ``[loaded_upto, end)`` (the engine recomputes them)."""

    loaded_upto: int
    bytes_received: int = 0
    seconds: float = 0.0
    peak_staging_bytes: int = 0
    rounds: int = 0
    error: str | None = None
    failed_block_ids: list[int] = field(default_factory=list)


def failed_blocks(block_size: int, local_block_ids: list[int], loaded_upto: int, end: int) -> list[int]:
    """Local blocks (of ``block_size`` tokens, table ``local_block_ids`` in token order) that hold any token of
    ``[loaded_upto, end)``: the blocks an engine must recompute after a partial load."""
    if loaded_upto >= end:
        return []
    return list(local_block_ids[loaded_upto // block_size:(end + block_size - 1) // block_size])


_pair_cache: dict[tuple[str, str, bool], list[str]] = {}
_pair_lock = threading.Lock()


def _cached_pair(src: dict[str, Any], dst: KVLayout, verify_weights: bool) -> list[str]:
    import json

    key = (json.dumps(src, sort_keys=True), dst.to_json(), verify_weights)
    with _pair_lock:
        r = _pair_cache.get(key)
    if r is None:
        r = check_pair(src, dst, verify_weights=verify_weights)
        with _pair_lock:
            if len(_pair_cache) > 256:
                _pair_cache.clear()
            _pair_cache[key] = r
    return r


def claim(params: Any, layout: KVLayout, num_prompt_tokens: int, local_hit_tokens: int, *,
          prompt_token_ids: Any = None, verify_weights: bool = True, tp_rank: int = 0) -> Claim:
    """Decide what to load for one request (side-effect free; pair checks are cached per layout pair).

    Args:
      params: the producer's parameters (dict or :class:`TransferParams`).
      layout: this consumer rank's KVLayout.
      num_prompt_tokens: the request's prompt length here; local_hit_tokens: tokens this engine already has
        (prefix cache).
      prompt_token_ids: this request's prompt token ids; when given and the producer stated a digest, a different
        prompt is refused.
    Returns a :class:`Claim` (never raises).
    """
    try:
        p = decode_params(params)
    except ContractError as e:
        return Claim(refused=e.reason)
    reasons = _cached_pair(p.layout, layout, verify_weights)
    if reasons:
        return Claim(refused="; ".join(reasons), params=p)
    if tp_rank >= len(p.transports):
        return Claim(refused=f"producer has {len(p.transports)} TP rank(s), consumer rank {tp_rank} has none",
                     params=p)
    if p.digest is not None and prompt_token_ids is not None:
        from .contract import prompt_digest

        n = min(p.num_tokens, int(num_prompt_tokens))
        try:
            mine = prompt_digest(list(prompt_token_ids)[:p.num_tokens])
        except ContractError as e:
            return Claim(refused=e.reason, params=p)
        if n < p.num_tokens or mine != p.digest:
            return Claim(refused=(f"prompt differs from the producer's: digest of this request's first "
                                  f"{p.num_tokens} prompt tokens is {mine[:23]}..., producer's {p.digest[:23]}... "
                                  "(chat template or BOS rules differ?)"), params=p)
    end = min(p.num_tokens, int(num_prompt_tokens))
    start = min(int(local_hit_tokens), end)
    return Claim(start=start, end=end, params=p)


class Consumer:
    """Pull bookkeeping over a transport (see module doc).

    Args:
      transport: a ``dlmix_kv_connectors`` transport with a registered ``staging`` region.
      layout: this rank's KVLayout; layers: this rank's per-layer caches (:mod:`dlmix.kv` form, destination).
      staging: the staging tensor (uint8, registered as region ``staging``).
      replies: ``request(req_id) -> (event, box)`` slot factory and ``drop(req_id)``: how answers reach the pull
        (the endpoint routes ``blocks_ready``/``refused`` there).
      io_timeout_s, registration_wait_s: seconds; verify_weights: see :func:`dlmix.pd.pair.check_pair`.
    """

    def __init__(self, transport: Any, layout: KVLayout, layers: list[Any], staging: Any, *,
                 slots: Any, io_timeout_s: float = 60.0, registration_wait_s: float = 10.0,
                 verify_weights: bool = True):
        self.t = transport
        self.layout = layout
        self.layers = layers
        self.staging = staging
        self.slots = slots
        self.io_timeout_s = io_timeout_s
        self.registration_wait_s = registration_wait_s
        self.verify_weights = verify_weights
        self._pull_lock = threading.Lock()  # one pull at a time uses the staging region

    def release(self, remote: dict[str, Any], remote_req_id: str, consumed: bool) -> None:
        """Tell producer ``remote`` (transport descriptor) it may free ``remote_req_id``'s blocks.
        Raises the transport's error when the producer is unreachable (its hold timeout frees them then)."""
        from .contract import Abort, Consumed

        peer = self.t.connect(remote, timeout_s=self.io_timeout_s)
        msg = Consumed(req=remote_req_id) if consumed else Abort(req=remote_req_id)
        self.t.notify(peer, encode(msg))

    def pull(self, remote: dict[str, Any], remote_req_id: str, remote_block_ids: list[int], start: int, end: int,
             local_block_ids: list[int], cancelled: Callable[[], bool] = lambda: False, *,
             src_layout: KVLayout | dict[str, Any] | None = None, digest: str | None = None,
             dst_layers: list[Any] | None = None) -> PullResult:
        """Load tokens ``[start, end)`` of the producer's request into this rank's blocks ``local_block_ids`` (the
        request's block table in token order). ``src_layout``: the producer's layout from the parameters (None:
        ask the producer for it once, in the ``blocks_ready`` answer). ``digest``: this request's prompt digest
        (the producer refuses a mismatch). ``dst_layers``: other caches of this rank's layout to load into instead
        of its own (a receive buffer an engine re-encodes afterwards, e.g. into an int8 cache). Never raises (see
        :class:`PullResult`)."""
        t0 = time.perf_counter()
        res = PullResult(loaded_upto=start)
        try:
            if self.staging is None:
                raise RuntimeError("this endpoint has no staging region (not a consumer)")
            src = None
            if src_layout is not None:
                src = layout_of(src_layout).with_rank(self.layout.tp_rank)
                reasons = check_pair(src, self.layout, verify_weights=self.verify_weights)
                if reasons:
                    raise PermissionError("incompatible prefill/decode pair: " + "; ".join(reasons))
            peer = self.t.connect(remote, timeout_s=self.io_timeout_s)
            ev, box = self.slots.open(remote_req_id)
            try:
                self.t.notify(peer, encode(Want(req=remote_req_id, block_ids=[int(b) for b in remote_block_ids],
                                                layout=self.layout.to_dict(), digest=digest,
                                                send_layout=src is None)))
                deadline = time.monotonic() + self.registration_wait_s + self.io_timeout_s
                while not ev.wait(0.1):
                    # A producer killed just before (its socket not yet seen closed when we notified) drops out of
                    # the live peers within a moment: fail fast instead of waiting for the timeout.
                    if peer not in self.t.peers():
                        raise ConnectionError(f"prefill {peer} disconnected before answering for {remote_req_id}")
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"no answer from prefill {peer} for {remote_req_id}")
            finally:
                self.slots.close(remote_req_id, (ev, box))
            reply = box[0]
            if reply.__class__.__name__ == "Refuse":
                raise PermissionError("prefill refused: " + "; ".join(reply.reasons))
            if src is None:
                if reply.layout is None:
                    raise RuntimeError("producer sent no layout and none came with the parameters")
                src = layout_of(reply.layout)
                reasons = check_pair(src, self.layout, verify_weights=self.verify_weights)
                if reasons:
                    raise PermissionError("incompatible prefill/decode pair: " + "; ".join(reasons))
            self._rounds(peer, remote_req_id, src, [int(b) for b in remote_block_ids], start, end,
                         list(local_block_ids), res, cancelled, self.layers if dst_layers is None else dst_layers)
        except Exception as e:
            res.error = f"{type(e).__name__}: {e}"
        res.failed_block_ids = failed_blocks(self.layout.block_size, list(local_block_ids), res.loaded_upto, end)
        res.seconds = time.perf_counter() - t0
        return res

    def pull_params(self, params: TransferParams, start: int, end: int, local_block_ids: list[int],
                    cancelled: Callable[[], bool] = lambda: False, *, digest: str | None = None) -> PullResult:
        """:meth:`pull` driven by decoded parameters (this rank's transport, the layout that came with them)."""
        try:
            remote = params.transport_for_rank(self.layout.tp_rank)
        except ContractError as e:
            return PullResult(loaded_upto=start, error=f"ContractError: {e.reason}",
                              failed_block_ids=failed_blocks(self.layout.block_size, local_block_ids, start, end))
        return self.pull(remote, params.request_id, params.block_ids, start, end, local_block_ids, cancelled,
                         src_layout=params.layout, digest=digest)

    def _rounds(self, peer: str, rid: str, src: KVLayout, rblocks: list[int], start: int, end: int,
                lblocks: list[int], res: PullResult, cancelled: Callable[[], bool], dst_layers: list[Any]) -> None:
        from dlmix.kv.ops import convert as kv_convert
        from dlmix.kv.ops import torch_dtype

        L = src.model.num_layers
        P = plane_count(src)
        pp = plane_page_bytes(src)
        ns = src.block_size
        per_block = L * P * pp  # staging bytes per producer block (all layers and planes)
        cap = self.staging.numel() // per_block
        if cap < 1:
            raise ValueError(f"staging region of {self.staging.numel()} B cannot hold one prefill block "
                             f"({per_block} B over {L} layers)")
        b0, b1 = start // ns, (end + ns - 1) // ns
        if b1 > len(rblocks):
            raise ValueError(f"remote has {len(rblocks)} blocks, tokens up to {end} need {b1}")
        sdt = torch_dtype(src)
        names = region_names(src)
        with self._pull_lock:
            c0 = b0
            while c0 < b1:
                if cancelled():
                    raise RuntimeError("cancelled: the decode request finished before its KV arrived")
                if c0 > b0:  # a long transfer: keep the prefill hold (and grant) alive for the next round
                    self.t.notify(peer, encode(Extend(req=rid)))
                c1 = min(b1, c0 + cap)
                n = c1 - c0
                segs = []
                for layer in range(L):
                    for pl in range(P):
                        base = (layer * P + pl) * n * pp
                        i = 0
                        while i < n:  # merge runs of consecutive remote blocks into one segment
                            j = i + 1
                            while j < n and rblocks[c0 + j] == rblocks[c0 + j - 1] + 1:
                                j += 1
                            segs.append(("staging", base + i * pp, names[layer][pl], rblocks[c0 + i] * pp,
                                         (j - i) * pp))
                            i = j
                h = self.t.read(peer, segs, transfer_id=rid, timeout_s=self.io_timeout_s)
                res.bytes_received += h.result(timeout=self.io_timeout_s + 5)
                res.peak_staging_bytes = max(res.peak_staging_bytes, L * P * n * pp)
                res.rounds += 1
                # convert tokens [t0, t1) from the staged producer pages into our blocks
                t0, t1 = max(start, c0 * ns), min(end, c1 * ns)
                src_caches = [self._staged_layer(src, sdt, layer, n, P, pp) for layer in range(L)]
                src_table = [0] * c0 + list(range(n))
                kv_convert(src, src_caches, src_table, self.layout, dst_layers, lblocks, t1, t0,
                           relax_fingerprint=not self.verify_weights)
                res.loaded_upto = t1
                c0 = c1

    def _staged_layer(self, src: KVLayout, sdt: Any, layer: int, n: int, P: int, pp: int) -> Any:
        area = self.staging[layer * P * n * pp:(layer + 1) * P * n * pp]
        shape = src.layer_shape(n)
        if src.separate_kv:
            return tuple(area[i * n * pp:(i + 1) * n * pp].view(sdt).view(shape[i]) for i in range(2))
        return area.view(sdt).view(shape)
