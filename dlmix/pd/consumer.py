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

import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from dlmix.kv.layout import KVLayout

from .contract import ContractError, Extend, TransferParams, Want, decode_params, encode
from .engine import head_subset, page_runs, plane_count, plane_page_bytes, region_names
from .pair import check_pair, layout_of

log = logging.getLogger("dlmix.pd.consumer")

#: the error of a pull whose request finished (cancelled) before its KV arrived
_CANCELLED = "cancelled: the decode request finished before its KV arrived"

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
    transport in ``rounds`` rounds, ``seconds`` wall time, of which ``grant_s`` waiting for the producers' answers to
    the wants (a producer waits for its engine to register the hold) and ``staging_wait_s`` waiting for its turn in
    the staging region (another pull of this rank was using it); ``error`` None on success;
    ``failed_block_ids``: local blocks covering ``[loaded_upto, end)`` (the engine recomputes them)."""

    loaded_upto: int
    bytes_received: int = 0
    seconds: float = 0.0
    peak_staging_bytes: int = 0
    rounds: int = 0
    grant_s: float = 0.0
    staging_wait_s: float = 0.0
    error: str | None = None
    failed_block_ids: list[int] = field(default_factory=list)


def _device_of(layers: list[Any]) -> Any:
    """The device of the first plane of ``layers`` (a tensor or a tuple of tensors per layer)."""
    first = layers[0]
    return (first[0] if isinstance(first, (tuple, list)) else first).device


def _synchronize(device: Any) -> None:
    """Wait for the work queued on ``device`` (CUDA, or any torch device module with ``synchronize``)."""
    import torch

    mod = getattr(torch, device.type, None)
    if mod is not None and hasattr(mod, "synchronize"):
        mod.synchronize(device)


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
    src_tp = layout_of(p.layout).tp_size
    if len(p.transports) != src_tp:
        return Claim(refused=f"producer sent {len(p.transports)} transport(s) for its {src_tp} TP rank(s)", params=p)
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
      connect_timeout_s: seconds to connect to a producer rank (TCP and the transport's handshake; an unreachable
        or silent producer fails that pull, or that release, after it); io_timeout_s, registration_wait_s: seconds;
        verify_weights: see :func:`dlmix.pd.pair.check_pair`.
    """

    def __init__(self, transport: Any, layout: KVLayout, layers: list[Any], staging: Any, *,
                 slots: Any, io_timeout_s: float = 60.0, registration_wait_s: float = 10.0,
                 verify_weights: bool = True, connect_timeout_s: float = 5.0):
        self.t = transport
        self.layout = layout
        self.layers = layers
        self.staging = staging
        self.slots = slots
        self.io_timeout_s = io_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.registration_wait_s = registration_wait_s
        self.verify_weights = verify_weights
        self._pull_lock = threading.Lock()  # one pull at a time uses the staging region
        self._dev_bufs: dict[Any, Any] = {}  # device -> a buffer the size of the staging region (device caches)

    def _targets(self, remote: Any) -> tuple[dict[int, dict[str, Any]], int]:
        """Producer ranks this rank may read or must release, and the ``ranks`` count to state to each.

        ``remote``: one transport descriptor (the producer rank paired with this rank: equal TP sizes) or the list
        of every producer rank's descriptor in rank order. Equal TP sizes: rank ``r`` deals with producer rank ``r``
        only. Different TP sizes: every rank of this instance releases every producer rank (so a producer rank that
        no one reads, a replica of a head, is released too), hence ``ranks`` = this instance's TP size."""
        if isinstance(remote, dict):
            return {self.layout.tp_rank: remote}, 1
        remotes = list(remote)
        if not remotes:
            raise ValueError("no producer transports given")
        if len(remotes) == self.layout.tp_size:
            return {self.layout.tp_rank: remotes[self.layout.tp_rank]}, 1
        return dict(enumerate(remotes)), self.layout.tp_size

    def release(self, remote: dict[str, Any] | list[dict[str, Any]], remote_req_id: str, consumed: bool) -> None:
        """Tell the producer (``remote``: see :meth:`_targets`) it may free ``remote_req_id``'s blocks: every
        producer rank this rank deals with. Raises the transport's error when a producer rank is unreachable (its
        hold timeout frees the blocks then), after notifying the others."""
        from .contract import Abort, Consumed

        targets, ranks = self._targets(remote)
        msg = Consumed(req=remote_req_id, ranks=ranks) if consumed else Abort(req=remote_req_id, ranks=ranks)
        err: Exception | None = None
        for desc in targets.values():
            try:
                peer = self.t.connect(desc, timeout_s=self.connect_timeout_s)
                self.t.notify(peer, encode(msg))
            except Exception as e:
                err = e
        if err is not None:
            raise err

    def pull(self, remote: dict[str, Any] | list[dict[str, Any]], remote_req_id: str, remote_block_ids: list[int],
             start: int, end: int, local_block_ids: list[int], cancelled: Callable[[], bool] = lambda: False, *,
             src_layout: KVLayout | dict[str, Any] | None = None, digest: str | None = None,
             dst_layers: list[Any] | None = None, consumers: int = 1) -> PullResult:
        """Load tokens ``[start, end)`` of the producer's request into this rank's blocks ``local_block_ids`` (the
        request's block table in token order).

        ``remote``: the producer rank's transport descriptor, or every producer rank's in rank order (see
        :meth:`_targets`). When the TP sizes differ, :func:`dlmix.kv.plan_heads` picks which producer rank provides
        which of this rank's KV heads (a replicated head is read once), each is asked for a grant, and only the
        bytes of those heads are read when the producer's arrangement allows (:func:`dlmix.pd.engine.page_runs`;
        else whole pages), then :func:`dlmix.kv.ops.convert_from_ranks` assembles this rank's blocks.
        ``src_layout``: the producer's layout from the parameters (None: ask the producer for it once, in the
        ``blocks_ready`` answer; one producer rank only). ``digest``: this request's prompt digest (the producer
        refuses a mismatch). ``dst_layers``: other caches of this rank's layout to load into instead of its own (a
        receive buffer an engine re-encodes afterwards, e.g. into an int8 cache). ``consumers``: pulls of this
        hold this rank's instance makes (``n`` choices; :class:`dlmix.pd.contract.Want`). Never raises (see
        :class:`PullResult`). Thread-safe: pulls from several threads overlap their connect and grant exchange (so a
        prefill that does not answer holds up only its own request) and take turns in the staging region."""
        t0 = time.perf_counter()
        res = PullResult(loaded_upto=start)
        try:
            if self.staging is None:
                raise RuntimeError("this endpoint has no staging region (not a consumer)")
            targets, ranks = self._targets(remote)
            src = None
            if src_layout is not None:
                src = layout_of(src_layout)
                reasons = check_pair(src, self.layout, verify_weights=self.verify_weights)
                if reasons:
                    raise PermissionError("incompatible prefill/decode pair: " + "; ".join(reasons))
            elif len(targets) > 1:
                raise ValueError("pulling from several producer ranks needs the producer's layout")
            plan = self._plan(src, targets)
            peers: dict[int, str] = {p: self.t.connect(targets[p], timeout_s=self.connect_timeout_s)
                                     for p, _ in plan}
            slots = {p: (peers[p], self.slots.open(peers[p], remote_req_id)) for p, _ in plan}
            asked = time.perf_counter()
            try:
                for p, _ in plan:
                    self.t.notify(peers[p], encode(Want(req=remote_req_id, block_ids=[int(b) for b in remote_block_ids],
                                                        layout=self.layout.to_dict(), digest=digest,
                                                        send_layout=src is None, ranks=ranks,
                                                        consumers=consumers)))
                deadline = time.monotonic() + self.registration_wait_s + self.io_timeout_s
                for p, (peer, (ev, _box)) in slots.items():
                    while not ev.wait(0.1):
                        # A producer killed just before (its socket not yet seen closed when we notified) drops out
                        # of the live peers within a moment: fail fast instead of waiting for the timeout.
                        if peer not in self.t.peers():
                            raise ConnectionError(f"prefill {peer} disconnected before answering for {remote_req_id}")
                        if time.monotonic() > deadline:
                            raise TimeoutError(f"no answer from prefill {peer} for {remote_req_id}")
                        if cancelled():  # the request finished: free this pull thread now, not at the deadline
                            raise RuntimeError(_CANCELLED)
            finally:
                res.grant_s = time.perf_counter() - asked
                for peer, slot in slots.values():
                    self.slots.close(peer, remote_req_id, slot)
            tids: dict[int, str] = {}
            wanted = [int(b) for b in remote_block_ids]
            pages: dict[int, list[int]] = {}
            for p, (_peer, (_ev, box)) in slots.items():
                reply = box[0]
                if reply.__class__.__name__ == "Refuse":
                    raise PermissionError("prefill refused: " + "; ".join(reply.reasons))
                tids[p] = reply.tid or remote_req_id
                pages[p] = wanted if reply.pages is None else list(reply.pages)
                if len(pages[p]) != len(wanted):
                    raise RuntimeError(f"prefill named {len(pages[p])} pages for {len(wanted)} blocks")
                if src is None:
                    if reply.layout is None:
                        raise RuntimeError("producer sent no layout and none came with the parameters")
                    src = layout_of(reply.layout)
                    reasons = check_pair(src, self.layout, verify_weights=self.verify_weights)
                    if reasons:
                        raise PermissionError("incompatible prefill/decode pair: " + "; ".join(reasons))
                    plan = self._plan(src, targets)
            sources = [(peers[p], tids[p], src.with_rank(p), heads, pages[p]) for p, heads in plan]
            self._rounds(remote_req_id, sources, start, end, list(local_block_ids), res, cancelled,
                         self.layers if dst_layers is None else dst_layers)
        except Exception as e:
            res.error = f"{type(e).__name__}: {e}"
        res.failed_block_ids = failed_blocks(self.layout.block_size, list(local_block_ids), res.loaded_upto, end)
        res.seconds = time.perf_counter() - t0
        return res

    def _plan(self, src: KVLayout | None, targets: dict[int, dict[str, Any]]) -> list[tuple[int, tuple[int, ...]]]:
        """``[(producer rank, KV heads it provides to this rank)]``; before the layout is known, the one target."""
        if src is None:
            (p,) = targets
            return [(p, tuple(self.layout.heads_for_rank()))]
        if any(not 0 <= p < src.tp_size for p in targets) or (len(targets) == 1 and src.tp_size > 1
                                                               and src.tp_size != self.layout.tp_size):
            raise ValueError(f"producer has TP {src.tp_size} and this consumer TP {self.layout.tp_size} (rank "
                             f"{self.layout.tp_rank}): the pull needs every producer rank's transport, in rank order")
        ranks = sorted(targets)
        from dlmix.kv.ops import plan_heads

        return [(ranks[i], heads) for i, heads in plan_heads([src.with_rank(p) for p in ranks], self.layout)]

    def pull_params(self, params: TransferParams, start: int, end: int, local_block_ids: list[int],
                    cancelled: Callable[[], bool] = lambda: False, *, digest: str | None = None) -> PullResult:
        """:meth:`pull` driven by decoded parameters (every producer rank's transport, the layout that came with
        them)."""
        return self.pull(list(params.transports), params.request_id, params.block_ids, start, end, local_block_ids,
                         cancelled, src_layout=params.layout, digest=digest)

    def _rounds(self, rid: str, sources: list[tuple[str, str, KVLayout, tuple[int, ...], list[int]]], start: int,
                end: int, lblocks: list[int], res: PullResult, cancelled: Callable[[], bool],
                dst_layers: list[Any]) -> None:
        """Read and convert in staging rounds. ``sources``: ``(peer, transfer id, producer rank layout, heads,
        pages)`` per producer rank read (``pages``: where the request's blocks are in that rank's regions, token
        order). Staging per round: source by source, layer by layer, plane by plane, block by block, each block
        holding the source's heads for this rank (a :func:`head_subset` page). When the destination cache is in
        device memory and the staging region is not, each round's staged bytes are copied to the device in one
        piece and converted there (the conversion runs where the destination lives)."""
        from dlmix.kv.ops import convert as kv_convert
        from dlmix.kv.ops import convert_from_ranks, torch_dtype

        src0 = sources[0][2]
        L = src0.model.num_layers
        P = plane_count(src0)
        ns = src0.block_size
        names = region_names(src0)
        sdt = torch_dtype(src0)
        spec = []  # (peer, tid, staged layout, runs per plane, staged bytes per plane page, source page bytes, pages)
        for peer, tid, lay, heads, rblocks in sources:
            runs = page_runs(lay, heads)
            sub = head_subset(lay, heads) if runs is not None else lay
            if runs is None:
                runs = [[(0, plane_page_bytes(lay))] for _ in range(P)]
            spec.append((peer, tid, sub, runs, plane_page_bytes(sub), plane_page_bytes(lay), rblocks))
        per_block = sum(L * P * s[4] for s in spec)  # staging bytes per producer block
        cap = self.staging.numel() // per_block
        if cap < 1:
            raise ValueError(f"staging region of {self.staging.numel()} B cannot hold one prefill block "
                             f"({per_block} B over {L} layers)")
        b0, b1 = start // ns, (end + ns - 1) // ns
        if b1 > len(spec[0][6]):
            raise ValueError(f"remote has {len(spec[0][6])} blocks, tokens up to {end} need {b1}")
        ddev = _device_of(dst_layers)
        on_device = ddev != self.staging.device
        queued = time.monotonic()
        with self._staging_turn(rid, spec, cancelled):  # extends the holds while it waits
            res.staging_wait_s = time.monotonic() - queued
            c0 = b0
            while c0 < b1:
                if cancelled():
                    raise RuntimeError(_CANCELLED)
                if c0 > b0:  # a long transfer: keep the prefill holds (and grants) alive for the next round
                    for peer, *_rest in spec:
                        self.t.notify(peer, encode(Extend(req=rid)))
                c1 = min(b1, c0 + cap)
                n = c1 - c0
                handles, areas, base = [], [], 0
                try:
                    for peer, tid, sub, runs, sp, pp, rblocks in spec:
                        segs = _round_segments(names, runs, sp, pp, rblocks, c0, n, base)
                        handles.append(self.t.read(peer, segs, transfer_id=tid, timeout_s=self.io_timeout_s))
                        areas.append((base, sub, sp))
                        base += L * P * n * sp
                    for h in handles:
                        res.bytes_received += h.result(timeout=self.io_timeout_s + 5)
                except BaseException:
                    # a failed (or refused) read must not leave the other ranks' reads landing in the staging
                    # region after this pull gave it up: cancel() returns once no byte of theirs can still land
                    for h in handles:
                        h.cancel()
                    raise
                res.peak_staging_bytes = max(res.peak_staging_bytes, base)
                res.rounds += 1
                # convert tokens [t0, t1) from the staged producer pages into our blocks
                t0, t1 = max(start, c0 * ns), min(end, c1 * ns)
                src_table = [0] * c0 + list(range(n))
                buf = self.staging
                if on_device:  # one host-to-device copy of the round, then convert on the destination's device
                    buf = self._device_buffer(ddev)[:base]
                    buf.copy_(self.staging[:base], non_blocking=self.staging.is_pinned())
                staged = [(sub, [self._staged_layer(buf, sub, sdt, at, layer, n, P, sp) for layer in range(L)],
                           src_table) for at, sub, sp in areas]
                if len(staged) == 1:
                    kv_convert(staged[0][0], staged[0][1], src_table, self.layout, dst_layers, lblocks, t1, t0,
                               relax_fingerprint=not self.verify_weights)
                else:
                    convert_from_ranks(staged, self.layout, dst_layers, lblocks, t1, t0,
                                       relax_fingerprint=not self.verify_weights)
                if on_device:  # the next round overwrites the host staging; the engine reads the blocks next
                    _synchronize(ddev)
                res.loaded_upto = t1
                c0 = c1

    @contextlib.contextmanager
    def _staging_turn(self, rid: str, spec: list, cancelled: Callable[[], bool]) -> Iterator[None]:
        """Hold the staging region for one pull. While another pull of this rank has it, keep this pull's prefill
        holds and grants alive (an ``Extend`` about every second: a producer drops a granted hold ``io_timeout_s``
        after the last want or extend, and a queued turn can last longer than that) and give up when the request
        is cancelled."""
        beat = max(0.05, min(1.0, self.io_timeout_s / 4))
        while not self._pull_lock.acquire(timeout=beat):
            if cancelled():
                raise RuntimeError(_CANCELLED)
            for peer, *_rest in spec:
                self.t.notify(peer, encode(Extend(req=rid)))
        try:
            yield
        finally:
            self._pull_lock.release()

    def _device_buffer(self, device: Any) -> Any:
        """A device buffer the size of the staging region (allocated once per device)."""
        import torch

        if device not in self._dev_bufs:
            self._dev_bufs[device] = torch.empty(self.staging.numel(), dtype=torch.uint8, device=device)
        return self._dev_bufs[device]

    @staticmethod
    def _staged_layer(buf: Any, src: KVLayout, sdt: Any, at: int, layer: int, n: int, P: int, pp: int) -> Any:
        area = buf[at + layer * P * n * pp:at + (layer + 1) * P * n * pp]
        shape = src.layer_shape(n)
        if src.separate_kv:
            return tuple(area[i * n * pp:(i + 1) * n * pp].view(sdt).view(shape[i]) for i in range(2))
        return area.view(sdt).view(shape)


def _round_segments(names: list, runs: list, sp: int, pp: int, rblocks: list, c0: int, n: int, base: int) -> list:
    """Segments ``(local region, local offset, remote region, remote offset, bytes)`` that read blocks ``c0 ..
    c0 + n`` of one producer rank into the staging region from byte ``base``: per layer and region plane
    (``names[layer][plane]``), ``n`` staged pages of ``sp`` bytes, each the byte ``runs`` of the producer's page of
    ``pp`` bytes at block ``rblocks[c0 + i]``. Whole pages (or one run each) of consecutive blocks merge into one
    segment."""
    segs = []
    P = len(runs)
    for layer, planes in enumerate(names):
        for pl in range(P):
            at = base + (layer * P + pl) * n * sp
            if len(runs[pl]) == 1:  # the whole page or one run of it: merge consecutive blocks
                off0, ln = runs[pl][0]
                i = 0
                while i < n:
                    j = i + 1
                    while ln == pp and j < n and rblocks[c0 + j] == rblocks[c0 + j - 1] + 1:
                        j += 1
                    segs.append(("staging", at + i * sp, planes[pl], rblocks[c0 + i] * pp + off0, (j - i) * ln))
                    i = j
            else:
                for i in range(n):
                    o = at + i * sp
                    for off, ln in runs[pl]:
                        segs.append(("staging", o, planes[pl], rblocks[c0 + i] * pp + off, ln))
                        o += ln
    return segs
