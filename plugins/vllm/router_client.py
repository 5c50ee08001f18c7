"""Registration and heartbeats of a vLLM instance with the dlmix router: vLLM's registration body on the core's
:class:`dlmix.pd.router_client.RouterClient` (the protocol and the thread live there).

Runs in a daemon thread of the EngineCore process (the scheduler-side connector starts it); the scheduling loop never
waits on the network. Body fields: ``url`` (``public_url``), ``role`` (from ``kv_role``), ``engine: "vllm"``,
``model``, ``chip``, ``block_size``, ``kv_layout``, ``transport`` (TP rank 0's descriptor), ``kv_events`` (the ZMQ
endpoint of ``--kv-events-config`` when enabled), ``heartbeat_ttl_s``, ``id`` (``engine_id``).
"""
from __future__ import annotations

from typing import Any, Callable

from dlmix.pd.registration import advertised_endpoint
from dlmix.pd.registration import registration_body as build_registration
from dlmix.pd.router_client import RouterClient as _CoreRouterClient

__all__ = ["RouterClient", "registration_body"]

_ROLES = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "both"}


def _kv_events_endpoint(vllm_config: Any, host: str) -> str | None:
    cfg = getattr(vllm_config, "kv_events_config", None)
    if cfg is None or not getattr(cfg, "enable_kv_cache_events", False) or getattr(cfg, "publisher", "") != "zmq":
        return None
    return advertised_endpoint(str(cfg.endpoint), host)


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


class RouterClient(_CoreRouterClient):
    """The core's :class:`dlmix.pd.router_client.RouterClient` with vLLM's registration body.

    Args:
      settings: :class:`dlmix_vllm.config.DLMixSettings` (``router_url``, ``public_url``, ``heartbeat_s``, ...).
      vllm_config, layout: this engine's config and KVLayout dict.
      transports: live dict of worker transport descriptors by TP rank (filled after the handshake).
      load: callable returning ``{"waiting", "running", "kv_usage"}`` (read without locks; approximate).
    """

    def __init__(self, settings: Any, vllm_config: Any, layout: dict[str, Any],
                 transports: dict[int, dict[str, Any]], load: Callable[[], dict[str, Any]]):
        self.settings = settings
        # the first wait gives the workers' handshake a moment, so the transport descriptor is included
        super().__init__(settings.router_url, lambda: registration_body(settings, vllm_config, layout, transports),
                         load, heartbeat_s=settings.heartbeat_s,
                         admin_key=getattr(settings, "router_admin_key", None) or None)
