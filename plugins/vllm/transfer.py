"""Compatibility name for the PD endpoint: the hold/grant/pull/convert logic lives in :mod:`dlmix.pd` (see
:mod:`dlmix.pd.endpoint`, :mod:`dlmix.pd.producer`, :mod:`dlmix.pd.consumer`); this module only re-exports it for
code that imported it from the vLLM plugin."""
from dlmix.pd.endpoint import DEFAULT_LOOPBACK_SECRET, Hold, KVEndpoint, PullResult

__all__ = ["KVEndpoint", "Hold", "PullResult", "DEFAULT_LOOPBACK_SECRET"]
