"""Router-aware SGLang scheduler: registration with the dlmix router and heartbeats of load and KV usage, installed
through SGLang's ``HookRegistry`` (an AFTER hook of ``sglang.srt.managers.scheduler.Scheduler.__init__``).

Active only when ``router_url`` is set in ``DLMIX_SGLANG_CONFIG`` (:mod:`dlmix_sglang.config`); the hook is then
registered by :func:`dlmix_sglang.register` in every SGLang process, and does its work in the scheduler of attention-
TP rank 0, pipeline stage 0, data-parallel rank 0 (one registration per instance). The protocol and the thread are
the core's :class:`dlmix.pd.router_client.RouterClient`; this module holds what is SGLang's:

* the registration body from ``ServerArgs``: ``url`` (``public_url``, default ``http://{host}:{port}``), ``role``
  (``--disaggregation-mode`` prefill / decode, else both), ``engine: "sglang"``, ``model`` (``--served-model-name``),
  ``block_size`` (``--page-size``), ``bootstrap_port`` (``--disaggregation-bootstrap-port``, prefill only),
  ``kv_events`` (the ZMQ endpoint of ``--kv-events-config``), ``num_chips`` (TP size unless set), ``chip``, and the
  dlmix transfer backend's KV layout when that backend is selected;
* the load, read without locks from the scheduler's own queues (approximate by design): ``running`` = requests in the
  running batch, ``waiting`` = the waiting queue plus the PD queues (prefill bootstrap; decode pre-allocation and
  transfer), ``kv_usage`` = SGLang's own token usage of the KV pool (``pool_stats_observer``, the figure its
  ``/metrics`` reports).
"""
from __future__ import annotations

import json
import logging
from typing import Any

from dlmix.pd.registration import advertised_endpoint, registration_body
from dlmix.pd.router_client import RouterClient

from .config import SGLangSettings

log = logging.getLogger("dlmix_sglang.router_hook")

__all__ = ["TARGET", "after_scheduler_init", "scheduler_body", "scheduler_load"]

#: The method the hook runs after (``HookRegistry`` target path).
TARGET = "sglang.srt.managers.scheduler.Scheduler.__init__"

_ROLES = {"prefill": "prefill", "decode": "decode"}


def _mode(scheduler: Any) -> str:
    m = getattr(scheduler, "disaggregation_mode", None)
    return str(getattr(m, "value", m) or "null")


def _kv_events_endpoint(server_args: Any, host: str) -> str | None:
    raw = getattr(server_args, "kv_events_config", None)
    if not raw:
        return None
    try:
        cfg = json.loads(raw) if isinstance(raw, str) else dict(raw)
    except (TypeError, ValueError):
        return None
    ep = cfg.get("endpoint")
    if cfg.get("publisher", "zmq") != "zmq" or not isinstance(ep, str) or not ep.startswith("tcp://"):
        return None
    return advertised_endpoint(ep, host)


def _dlmix_layout(scheduler: Any) -> dict[str, Any] | None:
    """The dlmix transfer backend's KV layout (``KVLayout.to_dict()``), or None under another backend."""
    for q in (getattr(scheduler, "disagg_prefill_bootstrap_queue", None),
              getattr(scheduler, "disagg_decode_prealloc_queue", None)):
        lay = getattr(getattr(q, "kv_manager", None), "layout", None)
        if lay is not None and hasattr(lay, "to_dict"):
            return lay.to_dict()
    return None


def scheduler_body(scheduler: Any, settings: SGLangSettings) -> dict[str, Any]:
    """The registration body of the instance this scheduler runs (see the module docstring). Raises
    :class:`dlmix.pd.contract.ContractError` for a body the router would refuse (e.g. a bad URL)."""
    sa = scheduler.server_args
    host = str(getattr(sa, "host", None) or "127.0.0.1")
    host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    url = settings.public_url or f"http://{host}:{sa.port}"
    role = _ROLES.get(_mode(scheduler), "both")
    model = getattr(sa, "served_model_name", None) or getattr(sa, "model_path", None)
    lay = _dlmix_layout(scheduler)
    return registration_body(
        url=url, role=role, engine="sglang", model=str(model) if model else None,
        chip=settings.chip_profile, num_chips=settings.num_chips or int(getattr(sa, "tp_size", 1) or 1),
        block_size=None if lay else int(getattr(sa, "page_size", None) or 1), kv_layout=lay,
        kv_events=_kv_events_endpoint(sa, host), heartbeat_ttl_s=max(3.0, 3 * settings.heartbeat_s),
        bootstrap_port=int(sa.disaggregation_bootstrap_port) if role == "prefill" else None)


def scheduler_load(scheduler: Any) -> dict[str, Any]:
    """``{"waiting", "running", "kv_usage"}`` of this scheduler, read without locks (see the module docstring)."""
    running = len(getattr(getattr(scheduler, "running_batch", None), "reqs", None) or ())
    waiting = len(getattr(scheduler, "waiting_queue", None) or ())
    for name in ("disagg_prefill_bootstrap_queue", "disagg_decode_prealloc_queue", "disagg_decode_transfer_queue"):
        q = getattr(scheduler, name, None)
        if q is not None:
            waiting += len(getattr(q, "queue", None) or ())
    usage = None
    obs = getattr(scheduler, "pool_stats_observer", None)
    if obs is not None:
        try:
            usage = float(obs.get_pool_stats().get_kv_token_stats()[1])
        except Exception as e:  # the pool changes under us: leave the figure out of this heartbeat
            log.debug("dlmix: KV usage not read: %s", e)
    return {"waiting": waiting, "running": running, "kv_usage": usage}


def _is_first_rank() -> bool:
    try:
        from sglang.srt.runtime_context import get_parallel
    except ImportError:  # an SGLang without the runtime context: the scheduler itself is the only rank
        return True
    p = get_parallel()
    ranks = ("attn_tp_rank", "attn_cp_rank", "pp_rank", "dp_rank", "attn_dp_rank")
    return all((getattr(p, a, 0) or 0) == 0 for a in ranks)


def after_scheduler_init(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER hook of ``Scheduler.__init__``: start the router client on the first rank (module docstring). Returns
    None (the constructor's result is left as it is)."""
    from .config import load_settings

    settings = load_settings()
    if not settings.router_url or not _is_first_rank():
        return None
    client = RouterClient(settings.router_url, lambda: scheduler_body(scheduler, settings),
                          lambda: scheduler_load(scheduler), heartbeat_s=settings.heartbeat_s,
                          admin_key=settings.router_admin_key)
    scheduler.dlmix_router_client = client
    client.start()
    log.info("dlmix: registering %s with router %s", _mode(scheduler), settings.router_url)
    return None
