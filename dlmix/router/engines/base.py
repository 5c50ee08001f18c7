"""The interface of a router engine adapter (one module per engine protocol), as a typed Protocol.

The router only calls these names on an instance's adapter (``get_engine(state.engine)``):

* ``NAME``: engine name used in registrations (``vllm``, ``sglang``, ``lmdeploy``).
* ``HEALTH_PATH`` / ``MODELS_PATH``: bytes paths of the health check and the model list.
* ``prefill_body(body, chat) -> bytes``: the prefill-leg request built from the client's parsed JSON ``body``
  (not modified); ``chat`` is True for ``/v1/chat/completions``.
* ``kv_transfer_params(resp_body) -> dict``: the transfer parameters out of the prefill response (for engines that
  speak the dlmix contract: a :class:`dlmix.pd.contract.TransferParams` dict). Raises ValueError when absent or
  malformed.
* ``decode_body(raw, kvp, parsed=None) -> bytes``: the decode-leg request: the client's original bytes plus ``kvp``.
  Raises ValueError when ``raw`` is not a JSON object.

A new engine is one file implementing these (copy :mod:`dlmix.router.engines.vllm`), added to
:data:`dlmix.router.engines.ENGINES`; ``tests/test_pd_contract.py`` checks every registered adapter against
:class:`EngineAdapter`.
"""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

__all__ = ["EngineAdapter"]


@runtime_checkable
class EngineAdapter(Protocol):
    """What the router needs from an engine adapter module (see module doc)."""

    NAME: str
    HEALTH_PATH: bytes
    MODELS_PATH: bytes

    def prefill_body(self, body: dict, chat: bool) -> bytes: ...

    def kv_transfer_params(self, resp_body: bytes) -> dict: ...

    def decode_body(self, raw: bytes, kvp: dict, parsed: Any = None) -> bytes: ...
