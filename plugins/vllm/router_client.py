"""Background registration and heartbeats of a vLLM instance with the dlmix router (``dlmix.router.server``).

Runs in a daemon thread of the EngineCore process (the scheduler-side connector starts it); the scheduling loop never
waits on the network. Contract (the router's admin API, see :mod:`dlmix.router.server`):

* ``POST {router}/admin/instances`` with ``{"url", "role" (prefill/decode/both), "engine": "vllm", "model", "chip",
  "block_size", "kv_layout" (KVLayout dict), "transport" (TP-rank-0 transport descriptor of this instance's worker),
  "kv_events" (ZMQ endpoint of ``--kv-events-config`` when enabled), "heartbeat_ttl_s", "id"}`` -> ``201 {"id"}``;
  ``409`` = layout incompatible with registered instances (logged with the reasons, retried slowly).
* ``POST {router}/admin/instances/{id}/heartbeat`` with ``{"waiting", "running", "kv_usage"}`` every
  ``heartbeat_s``; ``404`` -> register again.

``Authorization: Bearer <router_admin_key>`` is sent when configured.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable

from dlmix.pd.registration import registration_body as build_registration

log = logging.getLogger("dlmix_vllm.router_client")

__all__ = ["RouterClient", "registration_body"]

_ROLES = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "both"}


def _kv_events_endpoint(vllm_config: Any, host: str) -> str | None:
    cfg = getattr(vllm_config, "kv_events_config", None)
    if cfg is None or not getattr(cfg, "enable_kv_cache_events", False) or getattr(cfg, "publisher", "") != "zmq":
        return None
    ep = str(cfg.endpoint)
    return ep.replace("*", host).replace("0.0.0.0", host)


def registration_body(settings: Any, vllm_config: Any, layout: dict[str, Any],
                      transports: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The JSON body of ``POST /admin/instances`` for this instance: vLLM's settings mapped onto the one builder,
    :func:`dlmix.pd.registration.registration_body`. Pure function."""
    from urllib.parse import urlparse

    ktc = vllm_config.kv_transfer_config
    url = str(settings.public_url).rstrip("/")
    host = urlparse(url).hostname or "127.0.0.1"
    model = settings.model_name or getattr(vllm_config.model_config, "served_model_name", None) \
        or vllm_config.model_config.model
    return build_registration(
        url=url, instance_id=str(ktc.engine_id), role=_ROLES.get(str(ktc.kv_role), "both"), engine="vllm",
        model=model if isinstance(model, (str, list)) else str(model), chip=settings.chip_profile or None,
        kv_layout=layout or None, transport=dict(transports[min(transports)]) if transports else None,
        kv_events=_kv_events_endpoint(vllm_config, host),
        heartbeat_ttl_s=max(3.0, 3 * float(settings.heartbeat_s)))


class RouterClient:
    """Registers this instance with the router and heartbeats its load from a daemon thread.

    Args:
      settings: :class:`dlmix_vllm.config.DLMixSettings` (``router_url``, ``public_url``, ``heartbeat_s``, ...).
      vllm_config, layout: this engine's config and KVLayout dict.
      transports: live dict of worker transport descriptors by TP rank (filled after the handshake).
      load: callable returning ``{"waiting", "running", "kv_usage"}`` (read without locks; approximate).
    """

    def __init__(self, settings: Any, vllm_config: Any, layout: dict[str, Any],
                 transports: dict[int, dict[str, Any]], load: Callable[[], dict[str, Any]]):
        self.settings = settings
        self.vllm_config = vllm_config
        self.layout = layout
        self.transports = transports
        self.load = load
        self.base = str(settings.router_url).rstrip("/")
        self.instance_id: str | None = None
        self.registered = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dlmix-router-client", daemon=True)
        self.last_error: str | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _headers(self) -> dict[str, str]:
        key = getattr(self.settings, "router_admin_key", None)
        return {"Authorization": f"Bearer {key}"} if key else {}

    def _run(self) -> None:
        import httpx

        # Give the workers' handshake a moment so the transport descriptor is included.
        self._stop.wait(min(5.0, self.settings.heartbeat_s))
        with httpx.Client(timeout=5.0, headers=self._headers()) as http:
            while not self._stop.is_set():
                try:
                    if self.instance_id is None:
                        body = registration_body(self.settings, self.vllm_config, self.layout, self.transports)
                        r = http.post(f"{self.base}/admin/instances", json=body)
                        if r.status_code in (200, 201):
                            self.instance_id = str(r.json().get("id") or body["id"])
                            self.registered.set()
                            log.info("DLMix: registered with router %s as %s", self.base, self.instance_id)
                        else:
                            self.last_error = f"register: HTTP {r.status_code} {r.text[:300]}"
                            log.warning("DLMix: router registration refused: %s", self.last_error)
                            self._stop.wait(max(5.0, 5 * self.settings.heartbeat_s))
                            continue
                    ld = self.load()
                    hb = {"waiting": int(ld.get("waiting", 0)), "running": int(ld.get("running", 0))}
                    if ld.get("kv_usage") is not None:
                        hb["kv_usage"] = float(ld["kv_usage"])
                    r = http.post(f"{self.base}/admin/instances/{self.instance_id}/heartbeat", json=hb)
                    if r.status_code == 404:
                        self.instance_id = None
                        continue
                except Exception as e:  # router down: keep trying, never raise into vLLM
                    self.last_error = f"{type(e).__name__}: {e}"
                    log.debug("DLMix: router unreachable: %s", self.last_error)
                self._stop.wait(self.settings.heartbeat_s)
