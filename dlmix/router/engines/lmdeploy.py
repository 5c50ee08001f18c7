"""LMDeploy adapter (implements :class:`dlmix.router.engines.base.EngineAdapter`): LMDeploy's DistServe flow, the
one its own proxy runs (``lmdeploy/serve/proxy/proxy.py``, ``pytorch/disagg/conn/proxy_conn.py``), with the router's
placement instead of the proxy's:

* Prefill leg: the client's request with ``max_tokens=1`` (``max_completion_tokens=1`` for chat), ``stream=false``,
  no ``logprobs``/``top_logprobs`` (that token is not the client's answer, and LMDeploy refuses logprobs unless
  started with ``--logprobs-mode``), ``with_cache`` and ``preserve_cache`` (the prefill engine keeps the request's
  blocks and answers their ids in ``cache_block_ids``, and its first token in ``remote_token_ids``).
* Pair connection (:func:`connect_pair`, once per prefill/decode pair): ``GET /distserve/engine_info`` on both,
  ``POST /distserve/p2p_initialize`` on both, then ``POST /distserve/p2p_connect`` on each with the other's endpoint
  info. With ``--migration-backend DLMix`` the decode's ``p2p_connect`` runs dlmix's pair check and refuses an
  incompatible prefill with the reasons (:mod:`dlmix_lmdeploy.backend`).
* Decode leg: the client's original bytes plus ``migration_request`` (``remote_engine_id`` = the prefill's URL,
  ``remote_block_ids``, ``remote_token_id``, ``remote_session_id``, ``protocol``); the decode migrates the KV and
  continues from the prefill's first token.

Unlike LMDeploy's proxy, requests need no ``session_id``: the router never keys anything by the prefill's answered
``id`` (LMDeploy 0.18's proxy does, and fails concurrent requests without one: every prefill answers ``id`` ``-1``).
A decode-role LMDeploy engine serves only migrated requests here (``DECODE_NEEDS_PREFILL``); a Hybrid engine serves
whole requests (``BOTH_TAKES_PD`` False).
"""
from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Optional

import msgspec

from dlmix.router.bodies import add_keys, one_token_leg

NAME = "lmdeploy"
HEALTH_PATH = b"/health"
MODELS_PATH = b"/v1/models"
#: the prefill leg first; its answer (block ids, first token) goes into the decode leg's ``migration_request``
PD_FLOW = "sequential"
#: what the decode leg carries (LMDeploy's ``migration_request`` in the decode leg's body); only instances with the same flow and protocol pair
PD_PROTOCOL = "migration_request"
#: the fields of either leg that LMDeploy's proxy sets (``lmdeploy/serve/proxy/proxy.py``; the api server pops them in
#: ``serve/openai/endpoints/completions.py``): set by the router only (a client body naming one is refused;
#: ``preserve_cache`` would keep the request's KV blocks after its answer)
HANDOFF_FIELDS = ("migration_request", "with_cache", "preserve_cache")
#: a Decode-role engine is fed by a prefill engine
DECODE_NEEDS_PREFILL = True
#: a Hybrid engine has no DistServe connection: it serves whole requests only
BOTH_TAKES_PD = False
#: LMDeploy 0.18 refuses a chat request's ``n > 1`` with cache migration (``serve/openai/chat_completions/
#: validation.py``; its own proxy refuses ``n > 1`` in DistServe mode) and answers one choice to a completion's: the
#: router runs such a request as one request per choice, each with its own migration (:mod:`dlmix.router.choices`)
PD_CHOICES = "fan_out"
#: LMDeploy's ``MigrationProtocol.TCP`` (``pytorch/disagg/conn/protocol.py``); DLMix picks its own transport
PROTOCOL_TCP = 1
#: seconds for each connection-handshake call
CONNECT_TIMEOUT_S = 60.0

_enc = msgspec.json.Encoder()
log = logging.getLogger("dlmix.router.engines.lmdeploy")


class _PrefillResp(msgspec.Struct):
    id: Any = None
    cache_block_ids: list[int] | None = None
    remote_token_ids: list[int] | None = None


_dec_prefill = msgspec.json.Decoder(_PrefillResp)


def prefill_body(body: dict, chat: bool, kvp: Any = None) -> bytes:
    """JSON bytes of the prefill leg built from the client's parsed ``body`` (not modified). A request for ``n > 1``
    choices is prefilled once (``n=1``, :func:`dlmix.router.bodies.one_token_leg`: LMDeploy refuses ``n > 1`` with
    ``with_cache``); a vLLM decode fans it out into ``n`` choices, each pulling the one hold."""
    b = one_token_leg(body, chat)
    # the leg's one token is not the client's answer; LMDeploy refuses logprobs unless started with --logprobs-mode
    b.pop("logprobs", None)
    b.pop("top_logprobs", None)
    b["with_cache"] = True
    b["preserve_cache"] = True
    return _enc.encode(b)


def kv_transfer_params(resp_body: bytes) -> dict:
    """The ``migration_request`` fields a prefill answer gives (``remote_engine_id`` is set by :func:`pair_ready`).
    Raises ValueError when the answer has no block ids or first token (an engine without ``--role Prefill``)."""
    try:
        r = _dec_prefill.decode(resp_body)
    except (msgspec.DecodeError, msgspec.ValidationError) as ex:
        raise ValueError(f"prefill response is not valid JSON: {ex}") from None
    if not r.cache_block_ids or not r.remote_token_ids:
        raise ValueError("prefill response has no cache_block_ids/remote_token_ids (is the engine --role Prefill?)")
    try:
        sid = int(r.id)
    except (TypeError, ValueError):
        sid = 0  # a chat id ("chatcmpl-..."); DLMix keys the transfer by block ids, not by this
    return {"protocol": PROTOCOL_TCP, "remote_engine_id": None, "remote_session_id": sid,
            "remote_token_id": int(r.remote_token_ids[-1]), "remote_block_ids": [int(b) for b in r.cache_block_ids],
            "is_dummy_prefill": False}


def decode_body(raw: bytes, kvp: dict, parsed: Any = None) -> bytes:
    """The client's original bytes with ``"migration_request": kvp`` added. Raises ValueError if ``raw`` is not a
    JSON object."""
    return add_keys(raw, {"migration_request": kvp}, parsed)


_connected: dict[tuple[str, str], asyncio.Future] = {}


async def pair_ready(prefill_url: str, decode_url: str, kvp: dict) -> dict:
    """Complete ``kvp`` with the prefill's identity and make sure the pair is connected (:func:`connect_pair`, once
    per pair; concurrent first requests share the one handshake, a failed one is retried by the next request).
    Raises ValueError with the reason when the pair cannot be connected."""
    key = (prefill_url, decode_url)
    fut = _connected.get(key)
    if fut is None or (fut.done() and fut.exception() is not None):
        fut = _connected[key] = asyncio.ensure_future(connect_pair(prefill_url, decode_url))
    await asyncio.shield(fut)
    return {**kvp, "remote_engine_id": prefill_url}


async def abort_handoff(prefill_url: str, kvp: dict) -> None:
    """Free what a prefill holds for a decode leg that did not take it (the client went away, the decode failed):
    LMDeploy's ``POST /distserve/free_cache``, the session named by
    :func:`dlmix.pd.contract.block_ids_session_alias` of ``kvp["remote_block_ids"]`` (the api_server answers the
    user's session id, not the engine's; a DLMix prefill answers to the alias of its held blocks). Best effort: a
    failure is logged, and the prefill's ``hold_timeout_s`` frees the blocks anyway."""
    import httpx

    from dlmix.pd.contract import ContractError, block_ids_session_alias

    try:
        alias = block_ids_session_alias(kvp.get("remote_block_ids") or [])
        async with httpx.AsyncClient(timeout=CONNECT_TIMEOUT_S, trust_env=False) as client:
            r = await client.post(f"{prefill_url}/distserve/free_cache",
                                  json={"remote_engine_id": prefill_url, "remote_session_id": alias})
        if r.status_code != 200:
            log.warning("free_cache on %s answered %s: %s", prefill_url, r.status_code, r.text[:200])
    except (httpx.HTTPError, ContractError) as ex:
        log.warning("free_cache on %s failed: %s", prefill_url, ex)


def forget(url: str) -> None:
    """Drop the connections of an instance (it was removed or restarted)."""
    for key in [k for k in _connected if url in k]:
        del _connected[key]


async def distserve_call(client: Any, method: str, url: str, body: Any = None,
                         timeout_s: Optional[float] = None) -> Any:
    """One call to an LMDeploy engine's DistServe route with ``client`` (an ``httpx.AsyncClient``); its JSON (a JSON
    string is decoded too). The whole answer must come within ``timeout_s`` (default :data:`CONNECT_TIMEOUT_S`):
    httpx's own timeout bounds each read only, so an engine dribbling bytes would hold the call for ever. Raises
    ValueError with the engine's answer."""
    import httpx

    limit = CONNECT_TIMEOUT_S if timeout_s is None else timeout_s
    try:
        r = await asyncio.wait_for(client.request(method, url, json=body), limit)
    except httpx.HTTPError as ex:
        raise ValueError(f"{method} {url}: {type(ex).__name__}: {ex}") from None
    except asyncio.TimeoutError:
        raise ValueError(f"{method} {url}: no whole answer within {limit:.3g} s") from None
    if r.status_code != 200:
        raise ValueError(f"{method} {url} answered {r.status_code}: {r.text[:500]} (see that engine's log for the "
                         "reason)")
    out = r.json()
    return json.loads(out) if isinstance(out, str) else out


async def connect_pair(prefill_url: str, decode_url: str) -> None:
    """LMDeploy's DistServe connection handshake between a prefill and a decode engine (module doc). Raises
    ValueError with the engines' answers when a step fails."""
    import httpx

    async with httpx.AsyncClient(timeout=CONNECT_TIMEOUT_S, trust_env=False) as client:
        async def call(method: str, url: str, body: Any = None) -> Any:
            return await distserve_call(client, method, url, body)

        p_cfg = await call("GET", f"{prefill_url}/distserve/engine_info")
        d_cfg = await call("GET", f"{decode_url}/distserve/engine_info")
        p_init = await call("POST", f"{prefill_url}/distserve/p2p_initialize", {
            "protocol": PROTOCOL_TCP, "local_engine_id": prefill_url, "local_engine_config": p_cfg,
            "remote_engine_id": decode_url, "remote_engine_config": d_cfg})
        d_init = await call("POST", f"{decode_url}/distserve/p2p_initialize", {
            "protocol": PROTOCOL_TCP, "local_engine_id": decode_url, "local_engine_config": d_cfg,
            "remote_engine_id": prefill_url, "remote_engine_config": p_cfg})
        await call("POST", f"{prefill_url}/distserve/p2p_connect", {
            "protocol": PROTOCOL_TCP, "remote_engine_id": decode_url,
            "remote_engine_endpoint_info": d_init["engine_endpoint_info"],
            "remote_kvtransfer_endpoint_info": d_init["kvtransfer_endpoint_info"]})
        await call("POST", f"{decode_url}/distserve/p2p_connect", {
            "protocol": PROTOCOL_TCP, "remote_engine_id": prefill_url,
            "remote_engine_endpoint_info": p_init["engine_endpoint_info"],
            "remote_kvtransfer_endpoint_info": p_init["kvtransfer_endpoint_info"]})
