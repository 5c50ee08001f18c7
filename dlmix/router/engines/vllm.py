"""vLLM adapter (implements :class:`dlmix.router.engines.base.EngineAdapter`): PD request rewriting with
``kv_transfer_params``, vLLM's two-step disaggregated-serving proxy convention (see vLLM's
``vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py`` and its ``disagg_proxy`` examples). With
DLMixConnector the prefill's ``kv_transfer_params`` are :class:`dlmix.pd.contract.TransferParams` (they pass through
the router unchanged; the decode side validates them).

* Prefill leg: the client's request with ``max_tokens=1`` (and ``max_completion_tokens=1`` for chat),
  ``stream=false``, no ``stream_options``/``min_tokens`` (they would be rejected with max_tokens=1), and
  ``kv_transfer_params = {"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
  "remote_block_ids": null, "remote_host": null, "remote_port": null}``, and ``return_token_ids`` (the answer names
  its one token's id, which an LMDeploy decode continues from: :mod:`dlmix.router.engines.bridges`; vLLM before
  0.10.2 ignores the field). A request for ``n > 1`` choices is
  prefilled once (``n=1``).
* Decode leg: the client's original bytes with the prefill response's top-level ``kv_transfer_params`` added, and
  for ``n > 1`` ``"dlmix_consumers": n`` in them: vLLM's decode fans the request out into ``n`` child requests
  (``vllm/v1/engine/parallel_sampling.py``), each of which pulls the one held prompt KV and tells the producer (in
  its ``want``) how many pulls to wait for; the hold is released after the last of them. The decode side says it,
  not the prefill leg: a prefill of another engine knows no ``n``, and a decode of another engine (LMDeploy, which
  ignores ``n``) pulls once, so a count named at the prefill would keep that hold until its timeout.
"""
from __future__ import annotations

import msgspec

from dlmix.router.bodies import add_keys, n_choices, one_token_leg

NAME = "vllm"
HEALTH_PATH = b"/health"
MODELS_PATH = b"/v1/models"
#: the prefill leg first; its ``kv_transfer_params`` go into the decode leg
PD_FLOW = "sequential"
#: what the decode leg carries (vLLM's ``kv_transfer_params`` in the decode leg's body); only instances with the same flow and protocol pair
PD_PROTOCOL = "kv_transfer_params"
#: the request fields that carry the hand-off: set by the router only (a client body naming one is refused)
HANDOFF_FIELDS = ("kv_transfer_params",)
#: a decode-role (kv_consumer / kv_both) vLLM instance recomputes the prompt itself when no prefill is available
DECODE_NEEDS_PREFILL = False
#: a kv_both instance consumes KV from a prefill instance like a kv_consumer
BOTH_TAKES_PD = True

PREFILL_KV_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                     "remote_block_ids": None, "remote_host": None, "remote_port": None}

_enc = msgspec.json.Encoder()


class _PrefillResp(msgspec.Struct):
    kv_transfer_params: dict | None = None


_dec_prefill = msgspec.json.Decoder(_PrefillResp)


def prefill_body(body: dict, chat: bool, kvp: dict | None = None) -> bytes:
    """JSON bytes of the prefill-leg request built from the client's parsed ``body`` (not modified); ``kvp`` is
    unused (the sequential flow has no hand-off before the prefill)."""
    b = one_token_leg(body, chat)
    b.pop("min_tokens", None)
    b["return_token_ids"] = True
    b["kv_transfer_params"] = PREFILL_KV_PARAMS  # n > 1: one prefill (one_token_leg); decode_body names the n pulls
    return _enc.encode(b)


def decode_body(raw: bytes, kvp: dict, parsed: dict | None = None) -> bytes:
    """The client's original bytes with ``"kv_transfer_params": kvp`` added as a last top-level key (with
    ``"dlmix_consumers": n`` when ``parsed`` asks for ``n > 1`` choices; ``kvp`` is not modified).

    The bytes are spliced (no re-encoding) unless the client already sent ``kv_transfer_params`` (then ``parsed`` or
    a fresh decode is re-encoded with the key replaced). Raises ValueError if ``raw`` is not a JSON object.
    """
    n = n_choices(parsed)
    if n > 1:
        kvp = {**kvp, "dlmix_consumers": n}
    return add_keys(raw, {"kv_transfer_params": kvp}, parsed)


def kv_transfer_params(resp_body: bytes) -> dict:
    """Top-level ``kv_transfer_params`` of a prefill response. Raises ValueError if absent or malformed."""
    try:
        r = _dec_prefill.decode(resp_body)
    except (msgspec.DecodeError, msgspec.ValidationError) as ex:
        raise ValueError(f"prefill response is not valid JSON: {ex}") from None
    if not r.kv_transfer_params:
        raise ValueError("prefill response has no kv_transfer_params (is a kv_producer connector configured?)")
    return r.kv_transfer_params
