"""Registration and heartbeats of an LMDeploy engine with the dlmix router.

With ``router_url`` (and ``public_url``) in ``DLMIX_LMDEPLOY_CONFIG``, the engine process (the patched
``Engine.__init__``, :mod:`dlmix_lmdeploy.patches`) starts the core's :class:`dlmix.pd.router_client.RouterClient`,
whatever the migration backend. This module holds what is LMDeploy's:

* the registration body: ``url`` (``public_url``), ``role`` (``--role`` Prefill / Decode, else both), ``engine:
  "lmdeploy"``, ``model`` (``model_name``, default the model path the engine loaded: LMDeploy's default served
  name), ``block_size`` (``--cache-block-seq-len``), ``num_chips`` (the attention TP size unless set), ``chip``, and
  with ``--migration-backend DLMix`` the rank's KV layout and transport descriptor, and ``kv_events`` (the
  ``kv_events_endpoint`` the engine publishes its prefix cache on, :mod:`dlmix_lmdeploy.kv_events`);
* the load, read without locks from LMDeploy's scheduler: ``running`` = active sequences, ``waiting`` = waiting,
  ready and migrating sequences (the counts of its ``schedule_metrics``), ``kv_usage`` = used share of the block
  manager's KV blocks (blocks held for a decode count as used, unlike LMDeploy's own request-based figure).

Unlike LMDeploy's ``--proxy-url`` registration (``/nodes/add``, no heartbeats), the router then expires an engine
that stops heartbeating (``heartbeat_ttl_s`` = 3 x ``heartbeat_s``) and its policies see the engine's own load.
"""
from __future__ import annotations

import logging
from typing import Any

from urllib.parse import urlparse

from dlmix.pd.registration import advertised_endpoint, registration_body
from dlmix.pd.router_client import RouterClient

from .config import LMDeploySettings

log = logging.getLogger("dlmix_lmdeploy.router_hook")

__all__ = ["engine_body", "engine_load", "start"]

_ROLES = {"Prefill": "prefill", "Decode": "decode"}


def engine_body(engine: Any, settings: LMDeploySettings, rank: Any = None) -> dict[str, Any]:
    """The ``POST /admin/instances`` body of this engine (see the module docstring); ``rank``: its
    :class:`dlmix_lmdeploy.backend.Rank` when it runs the DLMix backend. Raises ContractError (from the builder) on a
    bad field."""
    cc = engine.cache_config
    role = _ROLES.get(getattr(getattr(cc, "role", None), "name", ""), "both")
    dist = getattr(engine, "dist_config", None)
    tp = int(getattr(dist, "attn_tp", 1) or 1) if dist is not None else 1
    return registration_body(
        url=str(settings.public_url), instance_id=settings.instance_id, role=role, engine="lmdeploy",
        model=settings.model_name or str(engine.model_path), chip=settings.chip_profile,
        num_chips=settings.num_chips or tp, block_size=None if rank is not None else int(cc.block_size),
        kv_layout=rank.layout if rank is not None else None,
        transport=rank.endpoint.descriptor() if rank is not None else None,
        kv_events=advertised_endpoint(settings.kv_events_endpoint, urlparse(str(settings.public_url)).hostname
                                      or "127.0.0.1") if settings.kv_events_endpoint else None,
        heartbeat_ttl_s=max(3.0, 3 * settings.heartbeat_s))


def engine_load(scheduler: Any) -> dict[str, Any]:
    """``{"waiting", "running", "kv_usage"}`` of LMDeploy's scheduler (no locks): the sequence counts its
    ``schedule_metrics`` reports, and the used share of the block manager's GPU blocks. Not ``schedule_metrics``'
    ``cache_usage``: by default (``LMDEPLOY_ENABLE_REQUEST_CACHE_USAGE_METRIC``) it counts only blocks of live
    sequences, so blocks a prefill holds for a decode would look free."""
    bm = scheduler.block_manager
    total = int(bm.num_gpu_blocks)
    used = 1.0 - bm.get_num_free_gpu_blocks() / total if total else 0.0
    waiting = scheduler.num_waiting() + scheduler.num_ready() + scheduler.num_remote_loading()
    return {"waiting": int(waiting), "running": int(scheduler.num_running()), "kv_usage": float(used)}


def start(engine: Any, rank: Any = None, settings: LMDeploySettings | None = None) -> RouterClient | None:
    """Start registering ``engine`` (an LMDeploy PyTorch ``Engine`` after its ``__init__``; ``rank``: its DLMix rank
    or None) with the router of ``settings`` (default: ``DLMIX_LMDEPLOY_CONFIG``). Returns the client, or None
    without ``router_url``. Raises the settings' error for a bad configuration."""
    if settings is None:
        from .config import load_settings

        settings = load_settings()
    if not settings.router_url:
        return None
    client = RouterClient(settings.router_url, lambda: engine_body(engine, settings, rank),
                          lambda: engine_load(engine.scheduler), heartbeat_s=settings.heartbeat_s,
                          admin_key=settings.router_admin_key)
    engine.dlmix_router_client = client
    client.start()
    log.info("dlmix: registering %s with router %s", settings.public_url, settings.router_url)
    return client
