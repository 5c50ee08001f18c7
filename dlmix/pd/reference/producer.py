"""The reference producer: a prefill "engine" written against the dlmix PD core alone.

It proves the core engine-neutral: no engine is imported, the KV cache is computed by transformers' forward pass
(:mod:`.model`) and kept in a paged layout unlike vLLM CPU's (:mod:`.cache`; default ``lmdeploy``: separate K and V
tensors per layer, each ``[blocks, 16, heads, head_size]`` (NHD), block size 16, fp16; vLLM CPU uses ``vllm_cpu``:
one ``[blocks, heads, N, 2 * head_size]`` tensor per layer with K transposed inside each page, block size a multiple
of 32, the model dtype). Everything about the transfer comes from the core:

* :class:`dlmix.pd.contract.TransferParams` (what the prefill leg answers, incl. the prompt digest),
* the core's producer side (hold the blocks, grant exactly those to the decode that asks, extend, release on
  consumed/abort/timeout, security-gate the pair and the digest), fed this producer's tensors and layout,
* :func:`dlmix.pd.pair.check_pair` (inside the producer side) and :func:`dlmix.kv.convert` (writing the cache).

What this module adds is only what an engine adapter adds: tokenization and the forward pass, block allocation,
and freeing blocks when the core says a hold is over.
"""
from __future__ import annotations

import logging
import os
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dlmix.kv import KVLayout, ModelIdentity
from dlmix.pd.fingerprint import weights_fingerprint

from .cache import PagedKVCache
from .model import TransformersPrefill
from .server import HTTPError, openai_response, request_error

log = logging.getLogger("dlmix.pd.reference")

__all__ = ["ReferenceConfig", "ReferenceProducer", "ENGINE_NAME"]

#: ``remote_engine`` of the parameters this producer hands out.
ENGINE_NAME = "reference"


@dataclass
class ReferenceConfig:
    """Settings of a reference producer.

    model_dir: Hugging Face folder (e.g. ``dlmix.models.prepare("smollm2")``). served_model_name: the OpenAI
    ``model`` name. arrangement/block_size/dtype: the paged cache's layout (any :data:`dlmix.kv.ARRANGEMENTS`
    entry of a non-MLA model; block size in tokens). kv_cache_bytes: cache size (bytes; blocks =
    ``kv_cache_bytes // layout.block_bytes()``). compute_dtype: forward-pass dtype. transport/kv_host/kv_port/
    secret: the core transport the decode pulls from (``tcp`` on loopback by default; port 0 = any free port).
    hold_timeout_s: blocks are freed this long after the prefill unless a decode consumed or is reading them.
    io_timeout_s: the core's read/extend window. verify_weights: check the decode's weights fingerprint.
    perturb_token: test hook, ``None`` normally; an index ``i`` makes the producer prefill the prompt with token
    ``i`` replaced by ``(id + 1) % vocab`` (a producer whose prompt differs by one token; its digest says so).
    """

    model_dir: str | Path
    served_model_name: str = "smollm2"
    arrangement: str = "lmdeploy"
    block_size: int = 16
    dtype: str = "fp16"
    kv_cache_bytes: int = 128 << 20
    compute_dtype: str = "float32"
    max_model_len: int = 2048
    transport: str = "tcp"
    kv_host: str = "127.0.0.1"
    kv_port: int = 0
    secret: str | None = None
    hold_timeout_s: float = 120.0
    io_timeout_s: float = 30.0
    verify_weights: bool = True
    perturb_token: int | None = None
    instance_id: str = field(default_factory=lambda: f"ref-{uuid.uuid4().hex[:12]}")


class ReferenceProducer:
    """Model + paged cache + the core's producer side. ``prefill(body, chat)`` answers one prefill leg; the
    core serves the decode's pulls on its transport thread; :meth:`close` stops everything.

    Raises ValueError for an inconsistent config (layout fields), ImportError without transformers/torch.
    """

    def __init__(self, cfg: ReferenceConfig):
        self.cfg = cfg
        self.served_model_name = cfg.served_model_name
        self.model = TransformersPrefill(cfg.model_dir, compute_dtype=cfg.compute_dtype,
                                         max_model_len=cfg.max_model_len)
        m = self.model
        ident = ModelIdentity(architecture=m.architecture, num_layers=m.num_layers, num_kv_heads=m.num_kv_heads,
                              head_size=m.head_size, attention=m.attention,
                              weights_fingerprint=weights_fingerprint(cfg.model_dir))
        self.layout = KVLayout(ident, block_size=int(cfg.block_size), dtype=cfg.dtype, arrangement=cfg.arrangement,
                               engine=f"dlmix-reference transformers {cfg.compute_dtype}")
        nb = int(cfg.kv_cache_bytes) // self.layout.block_bytes()
        if nb < 1:
            raise ValueError(f"kv_cache_bytes={cfg.kv_cache_bytes} holds no block of {self.layout.block_bytes()} B")
        self.cache = PagedKVCache(self.layout, nb)
        self._lock = threading.Lock()
        self._blocks: dict[str, list[int]] = {}  # request id -> blocks held for a decode
        self.counters = {"prefills": 0, "prompt_tokens": 0, "freed_requests": 0}
        self.core = self._start_core()
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap_loop, name="dlmix-ref-reaper", daemon=True)
        self._reaper.start()

    # ------------------------------------------------------------------------------------------ prefill leg
    def prefill(self, body: dict[str, Any], chat: bool) -> dict[str, Any]:
        """Answer one prefill leg (see :mod:`.server`). Raises :class:`~.server.HTTPError` (400 bad request or
        prompt, 404 a ``model`` other than the served one, as vLLM answers; 503 cache full). A ``model`` left out or
        empty is the served one, as in vLLM."""
        model = body.get("model")
        if model not in (None, "") and model != self.served_model_name:
            raise HTTPError(404, f"The model `{model}` does not exist (this reference producer serves "
                                 f"`{self.served_model_name}`)", "NotFoundError")
        ktp = body.get("kv_transfer_params")
        if not isinstance(ktp, dict) or ktp.get("do_remote_decode") is not True:
            raise HTTPError(400, "the reference producer only serves prefill legs: send kv_transfer_params "
                                 "{\"do_remote_decode\": true} (e.g. through the dlmix router with this instance as "
                                 "role prefill)")
        try:
            ids = self.model.prompt_ids(body, chat)
        except Exception as e:
            raise request_error(e) from None
        ids = self._maybe_perturb(ids)
        res = self.model.prefill(ids)
        try:
            blocks = self.cache.allocate(len(ids))
        except Exception as e:
            raise request_error(e) from None
        rid = f"{self.cfg.instance_id}-{uuid.uuid4().hex[:16]}"
        try:
            self.cache.store(res.keys, res.values, blocks)
            with self._lock:
                self._blocks[rid] = blocks
            params = self._hold(rid, blocks, ids)
        except Exception:
            with self._lock:
                self._blocks.pop(rid, None)
            self.cache.free(blocks)
            raise
        with self._lock:
            self.counters["prefills"] += 1
            self.counters["prompt_tokens"] += len(ids)
        return openai_response(rid=rid, model=self.served_model_name, chat=chat,
                               text=self.model.decode([res.next_token]), token_id=res.next_token,
                               prompt_tokens=len(ids), kv_transfer_params=params)

    def _maybe_perturb(self, ids: list[int]) -> list[int]:
        i = self.cfg.perturb_token
        if i is None:
            return ids
        out = list(ids)
        j = i if i >= 0 else len(out) + i
        if not 0 <= j < len(out):
            raise HTTPError(400, f"perturb_token={i} is outside the {len(out)}-token prompt")
        out[j] = (out[j] + 1) % int(self.model.config.vocab_size)
        return out

    # ------------------------------------------------------------------------------------------ the core
    def _start_core(self) -> Any:
        """The core's endpoint over this producer's tensors: transport, regions, producer side (no staging: this
        process never pulls)."""
        from dlmix.pd.endpoint import DEFAULT_LOOPBACK_SECRET, KVEndpoint

        cfg = self.cfg
        if cfg.secret is None and cfg.kv_host not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError(f"kv_host {cfg.kv_host!r} is not loopback: set a transport secret (--secret)")
        return KVEndpoint(cfg.transport, f"{cfg.instance_id}-r0-{os.getpid()}", cfg.secret or DEFAULT_LOOPBACK_SECRET,
                          cfg.kv_host, cfg.kv_port, self.layout, self.cache.tensors(), 0,
                          hold_timeout_s=cfg.hold_timeout_s, io_timeout_s=cfg.io_timeout_s,
                          verify_weights=cfg.verify_weights)

    def core_descriptor(self) -> dict[str, Any]:
        """The core transport's descriptor (what a consumer connects to; no secret)."""
        return self.core.descriptor()

    def _hold(self, rid: str, blocks: list[int], ids: list[int]) -> dict[str, Any]:
        """Hand ``blocks`` to the core's producer side and return the contract's parameters (wire dict)."""
        from dlmix.pd.contract import TransferParams, prompt_digest

        digest = prompt_digest(ids)
        params = TransferParams.make(engine=ENGINE_NAME, instance_id=self.cfg.instance_id,
                                     transports=[self.core.descriptor()], request_id=rid, block_ids=blocks,
                                     num_tokens=len(ids), layout=self.layout, digest=digest,
                                     expiry_s=self.cfg.hold_timeout_s)
        self.core.add_hold(rid, blocks, len(ids), digest)
        # vLLM's envelope flags ride along so the same dict is a valid vLLM kv_transfer_params
        return {"do_remote_prefill": True, "do_remote_decode": False, **params.to_dict()}

    def reap(self) -> list[str]:
        """Free the blocks of every hold the core has finished with (consumed, aborted, expired); returns their
        request ids. Called every 50 ms by a background thread."""
        done = sorted(self.core.take_finished())
        for rid in done:
            self._free(rid)
        return done

    def registration(self, url: str, *, chip: str | None = None) -> dict[str, Any]:
        """This instance's router registration body (``POST /admin/instances``, or an entry of the router config's
        ``instances``), built by the core's one builder: role ``prefill``, protocol ``vllm`` (the reference producer
        answers vLLM's two-step ``kv_transfer_params`` prefill leg, so the router's ``vllm`` adapter drives it), the
        KV layout (the router's pair check at registration) and the transport descriptor."""
        from dlmix.pd.registration import registration_body

        return registration_body(url=url, role="prefill", engine="vllm", instance_id=self.cfg.instance_id,
                                 model=self.served_model_name, chip=chip, kv_layout=self.layout,
                                 transport=self.core.descriptor())

    def _core_stats(self) -> dict[str, Any]:
        return {**self.core.stats, "holds": self.core.held_count()}

    def _close_core(self) -> None:
        self.core.close()

    # ------------------------------------------------------------------------------------------ lifecycle
    def _free(self, rid: str) -> None:
        """The core says ``rid``'s hold is over (consumed, aborted or expired): return its blocks."""
        with self._lock:
            blocks = self._blocks.pop(rid, None)
        if blocks is not None:
            self.cache.free(blocks)
            with self._lock:
                self.counters["freed_requests"] += 1

    def _reap_loop(self) -> None:
        while not self._stop.wait(0.05):
            try:
                self.reap()
            except Exception:  # keep reaping
                log.exception("reference producer: reaping holds failed")

    def held_requests(self) -> int:
        """Requests whose blocks are still held for a decode."""
        with self._lock:
            return len(self._blocks)

    def stats(self) -> dict[str, Any]:
        """Hold accounting (JSON-able): requests held, blocks used/free, counters, and the core's own numbers."""
        with self._lock:
            counters = dict(self.counters)
        return {"held_requests": self.held_requests(), "used_blocks": self.cache.used_blocks,
                "free_blocks": self.cache.free_blocks, "num_blocks": self.cache.num_blocks,
                "layout": self.layout.to_dict(), **counters, "core": self._core_stats()}

    def close(self) -> None:
        """Stop the reaper (joined, at most 5 s) and the core's transport."""
        self._stop.set()
        self._reaper.join(5.0)
        self._close_core()
