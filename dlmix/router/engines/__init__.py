"""Engine adapters: everything engine-specific the router needs, one small module per engine protocol.

Each adapter module implements :class:`dlmix.router.engines.base.EngineAdapter` (``NAME``, ``HEALTH_PATH``,
``MODELS_PATH``, ``PD_FLOW``, ``prefill_body``, ``kv_transfer_params``, ``decode_body``); see that module for the
contract. PD across engines goes through :mod:`dlmix.router.engines.bridges` (:func:`can_pair`).
"""
from __future__ import annotations

from typing import Dict

from dlmix.router.bodies import RouterFields
from dlmix.router.engines import lmdeploy, sglang, vllm
from dlmix.router.engines.base import EngineAdapter

ENGINES: Dict[str, EngineAdapter] = {vllm.NAME: vllm, sglang.NAME: sglang, lmdeploy.NAME: lmdeploy}  # type: ignore[dict-item]

#: every adapter's hand-off fields: the router refuses a client body that sets one (400)
ROUTER_FIELDS = RouterFields(f for e in ENGINES.values() for f in e.HANDOFF_FIELDS)


def get_engine(name: str) -> EngineAdapter:
    """Adapter module by engine name. Raises ValueError for an unknown engine."""
    try:
        return ENGINES[name]
    except KeyError:
        raise ValueError(f"unknown engine {name!r}; supported: {', '.join(ENGINES)}") from None


def pd_key(adapter: EngineAdapter) -> str:
    """What must be equal for a prefill and a decode instance to pair: ``"FLOW/PROTOCOL"`` (e.g.
    ``sequential/kv_transfer_params`` for vLLM, ``sequential/migration_request`` for LMDeploy)."""
    return f"{adapter.PD_FLOW}/{adapter.PD_PROTOCOL}"


def can_pair(prefill: EngineAdapter, decode: EngineAdapter) -> bool:
    """True when a prefill instance of engine ``prefill`` can feed a decode instance of engine ``decode``: the same
    PD flow and protocol (:func:`pd_key`), or a bridge between the two engines
    (:data:`dlmix.router.engines.bridges.BRIDGES`)."""
    from dlmix.router.engines.bridges import get_bridge

    return pd_key(prefill) == pd_key(decode) or get_bridge(prefill.NAME, decode.NAME) is not None
