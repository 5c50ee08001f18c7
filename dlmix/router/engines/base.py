"""The interface of a router engine adapter (one module per engine protocol), as a typed Protocol.

The router only calls these names on an instance's adapter (``get_engine(state.engine)``):

* ``NAME``: engine name used in registrations (``vllm``, ``sglang``, ``lmdeploy``).
* ``HEALTH_PATH`` / ``MODELS_PATH``: bytes paths of the health check and the model list.
* ``PD_FLOW``: how a disaggregated request runs. ``"sequential"`` (vLLM): the prefill leg first, its answer's
  ``kv_transfer_params`` go into the decode leg. ``"concurrent"`` (SGLang): both legs at once, joined by a hand-off
  the router makes before either starts (``handoff(host, bootstrap_port) -> dict``).
* ``PD_PROTOCOL``: what carries the hand-off (``kv_transfer_params`` for vLLM, ``bootstrap`` for SGLang,
  ``migration_request`` for LMDeploy). The router pairs a prefill and a decode instance only when both their flows
  and protocols are equal (:func:`dlmix.router.engines.pd_key`; registration answers 409 otherwise).
* ``HANDOFF_FIELDS``: the top-level request fields that carry the hand-off in either leg. Only the router sets them:
  it refuses a client body that sets one of any engine's (400; :class:`dlmix.router.bodies.RouterFields`).
* ``DECODE_NEEDS_PREFILL``: True when a decode-role instance cannot serve a request alone (then, without a prefill
  instance, the router answers 503 rather than sending it there).
* ``BOTH_TAKES_PD``: True when a ``both``-role instance can be the decode side of a PD pair (vLLM with ``kv_both``);
  False when it serves only whole requests (an SGLang server without ``--disaggregation-mode``, which ignores the
  bootstrap fields and would leave the prefill leg waiting for a decode that never comes): the router then serves
  the request on it alone, even when the policy paired it with a prefill instance.
* ``prefill_body(body, chat, kvp=None) -> bytes``: the prefill-leg request built from the client's parsed JSON
  ``body`` (not modified); ``chat`` is True for ``/v1/chat/completions``; ``kvp``: the hand-off (concurrent flow).
* ``kv_transfer_params(resp_body) -> dict``: the transfer parameters out of the prefill response (sequential flow;
  for engines that speak the dlmix contract: a :class:`dlmix.pd.contract.TransferParams` dict). Raises ValueError
  when absent or malformed.
* ``decode_body(raw, kvp, parsed=None) -> bytes``: the decode-leg request: the client's original bytes plus ``kvp``
  (the transfer parameters, or the hand-off). Raises ValueError when ``raw`` is not a JSON object.
* optional ``async pair_ready(prefill_url, decode_url, kvp) -> dict`` (sequential flow): called after the prefill
  leg, before the decode leg; completes ``kvp`` and prepares the pair (LMDeploy: the DistServe connection handshake,
  once per pair). Raises ValueError with the reason when the pair cannot work; the router then answers 502.
* optional ``async abort_handoff(prefill_url, kvp)`` (sequential flow): the decode leg did not take the KV the
  prefill holds (client gone, decode failed or answered non-200, the pair could not be prepared): free it now instead
  of at the prefill's hold timeout (LMDeploy: ``/distserve/free_cache``). ``kvp`` is this adapter's own
  ``kv_transfer_params`` of the prefill's answer, also when a bridge handed the decode another engine's. Best
  effort, never raises; freeing KV the decode already took must be harmless.
* optional ``PD_CHOICES = "fan_out"``: this engine, as the decode side of a PD pair, cannot serve ``n > 1`` choices
  in one request (SGLang: the choices share one bootstrap room; LMDeploy: cache migration refuses a chat ``n > 1``
  and a completion gets one choice): the router runs such a request as ``n`` requests of one choice each, every one
  with its own prefill leg and hand-off, and merges their answers (:mod:`dlmix.router.choices`).
* optional ``forget(url)``: drop what the adapter remembers about the instance at ``url`` (LMDeploy: the pairs it
  connected); the registry calls it whenever an instance registers (a restarted engine may have another transport
  endpoint behind the same address) or is removed.

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
    PD_FLOW: str
    PD_PROTOCOL: str
    HANDOFF_FIELDS: tuple
    DECODE_NEEDS_PREFILL: bool
    BOTH_TAKES_PD: bool

    def prefill_body(self, body: dict, chat: bool, kvp: Any = None) -> bytes: ...

    def kv_transfer_params(self, resp_body: bytes) -> dict: ...

    def decode_body(self, raw: bytes, kvp: dict, parsed: Any = None) -> bytes: ...
