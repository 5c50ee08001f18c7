"""SGLang adapter (implements :class:`dlmix.router.engines.base.EngineAdapter`): SGLang's PD flow, in which the
router sends the client's request to the prefill and the decode instance *at the same time*, both carrying
``bootstrap_host``/``bootstrap_port``/``bootstrap_room`` (SGLang's ``PDRoutingFields`` in
``sglang/srt/entrypoints/openai/protocol.py``, accepted by ``/generate``, ``/v1/completions`` and
``/v1/chat/completions``; SGLang's own router, PyPI ``sglang-router``, sends the same fields). The decode server
pre-allocates its pages and asks the prefill's bootstrap server (``--disaggregation-bootstrap-port``) for the KV
of room ``bootstrap_room``; with ``--disaggregation-transfer-backend dlmix`` the KV moves over the dlmix PD core
(converted between page sizes, dtypes and layouts) and with any other backend over that backend; the router does not
care which.

* Hand-off: ``{"bootstrap_host": <prefill URL's host>, "bootstrap_port": <its bootstrap port>, "bootstrap_room":
  <random 63-bit int>}``, known before either leg starts (:func:`handoff`).
* Prefill leg: the client's request plus the hand-off, ``stream=false`` (its answer is only waited for, not
  forwarded); decode leg: the client's original bytes plus the hand-off (:func:`decode_body`).
* A decode-mode SGLang server cannot serve a request alone (``DECODE_NEEDS_PREFILL``): without a prefill instance
  the router answers 503 instead of sending it there. A server without a disaggregation mode (role ``both``) serves
  whole requests only (``BOTH_TAKES_PD`` False).
"""
from __future__ import annotations

import random

import msgspec

from dlmix.router.bodies import add_keys

NAME = "sglang"
#: a flag check; SGLang's ``/health`` runs a one-token generation and answers after at least 1 s
#: (``sglang/srt/entrypoints/http_server.py``), longer than the router's health timeout
HEALTH_PATH = b"/ready"
MODELS_PATH = b"/v1/models"
#: both legs at once, joined by bootstrap fields (vLLM's is ``"sequential"``: prefill first, then decode)
PD_FLOW = "concurrent"
#: what the decode leg carries (SGLang's bootstrap fields in both legs); only instances with the same flow and protocol pair
PD_PROTOCOL = "bootstrap"
#: the fields a router injects into either leg (SGLang's ``PDRoutingFields`` in
#: ``sglang/srt/entrypoints/openai/protocol.py``): set by the router only (a client body naming one is refused)
HANDOFF_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room", "disagg_prefill_dp_rank", "routed_dp_rank")
#: a decode-role instance needs a prefill instance for every request
DECODE_NEEDS_PREFILL = True
#: for ``n > 1`` SGLang 0.5.23's tokenizer manager first sends a prefix warm-up request (``max_new_tokens=0``) and then
#: the ``n`` samples, all copies of the first request and so under its one bootstrap room
#: (``sglang/srt/managers/tokenizer_manager.py`` ``_handle_batch_request``): on a decode server they would wait for KV
#: that one prefill room cannot give them all. The router runs such a request as one request per choice instead
#: (:mod:`dlmix.router.choices`).
PD_CHOICES = "fan_out"
#: a server without ``--disaggregation-mode`` (registered as ``both``) ignores the bootstrap fields: it cannot be a
#: decode leg, and a prefill leg paired with it would wait for a decode that never comes
BOTH_TAKES_PD = False

_enc = msgspec.json.Encoder()
_rng = random.SystemRandom()


def handoff(host: str, bootstrap_port: int, room: int | None = None) -> dict:
    """The bootstrap fields both legs carry: the prefill instance's ``host`` and ``bootstrap_port`` and a fresh
    random 63-bit ``bootstrap_room`` (unless ``room`` is given)."""
    return {"bootstrap_host": host, "bootstrap_port": int(bootstrap_port),
            "bootstrap_room": _rng.getrandbits(63) if room is None else int(room)}


def prefill_body(body: dict, chat: bool, kvp: dict | None = None) -> bytes:
    """JSON bytes of the prefill leg: the client's parsed ``body`` (not modified) with the hand-off ``kvp`` and
    ``stream=false`` (no ``stream_options``). Raises ValueError without a hand-off."""
    if not kvp:
        raise ValueError("SGLang's prefill leg needs the bootstrap hand-off")
    b = dict(body)
    b["stream"] = False
    b.pop("stream_options", None)
    b.update(kvp)
    return _enc.encode(b)


def decode_body(raw: bytes, kvp: dict, parsed: dict | None = None) -> bytes:
    """The client's original bytes with the hand-off's keys added at the top level (spliced, not re-encoded, unless
    the client already sent one of them: then ``parsed`` or a fresh decode is re-encoded with them replaced).
    Raises ValueError if ``raw`` is not a JSON object."""
    return add_keys(raw, kvp, parsed)


def kv_transfer_params(resp_body: bytes) -> dict:
    """Not used by SGLang's flow (the hand-off is made before the legs start). Raises ValueError."""
    raise ValueError("SGLang hands KV off through bootstrap fields, not kv_transfer_params")
