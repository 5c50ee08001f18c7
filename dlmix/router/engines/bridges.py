"""PD across engines: a prefill instance of one engine feeding a decode instance of another.

Each engine's PD flow hands the decode something of its own (:mod:`dlmix.router.engines.base` ``PD_PROTOCOL``). Two
instances of the same engine always pair; instances of two engines pair only when a *bridge* below turns the
prefill's answer into what the decode engine consumes. A bridge is one async function, registered in
:data:`BRIDGES` under ``(prefill engine, decode engine)``::

    async def bridge(prefill_url: str, decode_url: str, kvp: dict, resp_body: bytes) -> dict

``kvp`` is the prefill adapter's ``kv_transfer_params(resp_body)``; the result goes to the decode adapter's
``decode_body``. It raises ValueError with the reason when the pair cannot work (the router answers 502). The KV
itself never passes through the router: both engines' dlmix adapters speak the PD core's pull contract
(:mod:`dlmix.pd.contract`), so the decode pulls from the prefill's transport endpoint and converts block size, dtype
and arrangement on the way; the bridge only translates the hand-off.

Bridges:

* ``lmdeploy -> vllm`` (:func:`lmdeploy_to_vllm`): an LMDeploy prefill with ``--migration-backend DLMix`` holds the
  prompt's blocks under :func:`dlmix.pd.contract.block_ids_transfer_id` of its ``cache_block_ids``; the bridge asks
  the prefill once for its DLMix endpoint info (LMDeploy's ``/distserve/engine_info`` and
  ``/distserve/p2p_initialize``: the transport descriptor and KV layout) and builds the
  :class:`~dlmix.pd.contract.TransferParams` a vLLM ``DLMixConnector`` consumer reads. The parameters carry no prompt
  digest (the router never sees token ids); the vLLM consumer sends its own prompt's digest in its ``want`` and the
  prefill's gate refuses a prompt that differs from the one it held (then vLLM computes the prompt itself).
* ``vllm -> lmdeploy`` (:func:`vllm_to_lmdeploy`): a vLLM prefill with ``DLMixConnector`` (``kv_producer``) answers
  :class:`~dlmix.pd.contract.TransferParams` and, asked by the router's prefill leg (``return_token_ids``), the id of
  its one token. The bridge connects the LMDeploy decode to the prefill through LMDeploy's own DistServe routes
  (``/distserve/p2p_initialize`` and ``/distserve/p2p_connect`` on the decode, once per prefill endpoint, with the
  prefill's transport descriptor and layout as the remote's DLMix endpoint info: the decode's pair check runs there)
  and builds LMDeploy's ``migration_request`` (the prefill's block ids and first token). The LMDeploy decode pulls
  the hold under :func:`dlmix.pd.contract.block_ids_transfer_id` of those blocks, a name every dlmix producer
  answers to (:mod:`dlmix.pd.producer`), with its own prompt's digest, and continues from the prefill's token.
* ``sglang -> vllm`` (:func:`sglang_to_vllm`) and ``sglang -> lmdeploy`` (:func:`sglang_to_lmdeploy`): SGLang's
  flow is concurrent (the prefill runs a room only once a decode waits for it, and answers only after the decode
  has read the KV), so the router sends the prefill leg with the bootstrap fields and, at the same time, asks the
  prefill's bootstrap server for the room's hand-off (:func:`room_handoff`, ``POST /dlmix/handoff``: the dlmix
  SGLang backend stands in for the decode's side of the room and answers with the
  :class:`~dlmix.pd.contract.TransferParams` and the first token once the KV is held). The bridge's ``kvp`` is the
  SGLang hand-off plus ``timeout_s``; ``resp_body`` is unused. The decode pulls, its ``blocks_consumed`` marks the
  room a success on the prefill, and SGLang then finishes the prefill leg
  (:meth:`dlmix.router.orchestrator.PDOrchestrator.bridged`).

* ``vllm -> sglang`` (:func:`vllm_to_sglang`) and ``lmdeploy -> sglang`` (:func:`lmdeploy_to_sglang`): an SGLang
  decode learns of its KV only through a bootstrap room, so the router stands in for the prefill's bootstrap side
  (:mod:`dlmix.router.rooms`): the bridge files the prefill's :class:`~dlmix.pd.contract.TransferParams` and first
  token under a fresh room and answers the bootstrap fields naming this router. The decode's dlmix backend asks the
  router for the room (``POST /dlmix/handoff``), pulls, and continues from the prefill's token.

Every bridge takes the keyword ``rooms`` besides, the router's :class:`~dlmix.router.rooms.RoomTable` (used by the
bridges to SGLang).
"""
from __future__ import annotations

import asyncio
import json
from typing import Any, Awaitable, Callable, Dict, Optional, Tuple

import msgspec

from dlmix.pd.contract import ContractError, TransferParams, block_ids_transfer_id, decode_params

__all__ = ["BRIDGES", "Bridge", "get_bridge", "lmdeploy_to_vllm", "vllm_to_lmdeploy", "sglang_to_vllm",
           "sglang_to_lmdeploy", "vllm_to_sglang", "lmdeploy_to_sglang", "room_handoff", "forget"]

#: ``bridge(prefill_url, decode_url, kvp, resp_body, *, rooms=None)``
Bridge = Callable[..., Awaitable[dict]]

#: seconds for each call to a prefill engine while the bridge learns its endpoint
INFO_TIMEOUT_S = 60.0


class _Usage(msgspec.Struct):
    prompt_tokens: int


class _Answer(msgspec.Struct):
    usage: Optional[_Usage] = None


class _Choice(msgspec.Struct):
    token_ids: Optional[list] = None


class _VllmAnswer(msgspec.Struct):
    choices: list[_Choice] = []


_dec_answer = msgspec.json.Decoder(_Answer)
_dec_vllm = msgspec.json.Decoder(_VllmAnswer)
_info: Dict[str, asyncio.Future] = {}
_links: Dict[Tuple[str, str, str], asyncio.Future] = {}


def forget(url: str) -> None:
    """Drop what the bridges learnt about an instance (it was removed or restarted)."""
    _info.pop(url, None)
    for key in [k for k in _links if url in k[:2]]:
        del _links[key]


async def _call(client: Any, method: str, url: str, body: Any = None) -> Any:
    """One call to an LMDeploy engine's DistServe route, whole answer within INFO_TIMEOUT_S
    (:func:`dlmix.router.engines.lmdeploy.distserve_call`)."""
    from dlmix.router.engines.lmdeploy import distserve_call

    return await distserve_call(client, method, url, body, INFO_TIMEOUT_S)


async def _lmdeploy_endpoint(prefill_url: str, decode_url: str) -> dict:
    """The LMDeploy prefill's DLMix endpoint info (``{"dlmix": 1, "role", "transport", "layout"}``), asked once per
    prefill instance (concurrent first requests share the one call; a failed one is retried by the next request).
    Raises ValueError with the engine's answer."""
    fut = _info.get(prefill_url)
    if fut is None or (fut.done() and fut.exception() is not None):
        fut = _info[prefill_url] = asyncio.ensure_future(_ask_lmdeploy(prefill_url, decode_url))
    return await asyncio.shield(fut)


async def _ask_lmdeploy(prefill_url: str, decode_url: str) -> dict:
    import httpx

    from dlmix.router.engines.lmdeploy import PROTOCOL_TCP

    async with httpx.AsyncClient(timeout=INFO_TIMEOUT_S, trust_env=False) as client:
        cfg = await _call(client, "GET", f"{prefill_url}/distserve/engine_info")
        # LMDeploy's p2p_initialize wants the remote side's engine config too; a vLLM decode has none, and the DLMix
        # backend only records the link, so the prefill's own config stands in
        init = await _call(client, "POST", f"{prefill_url}/distserve/p2p_initialize", {
            "protocol": PROTOCOL_TCP, "local_engine_id": prefill_url, "local_engine_config": cfg,
            "remote_engine_id": decode_url, "remote_engine_config": cfg})
    try:
        per_rank = init["kvtransfer_endpoint_info"]
        if len(per_rank) != 1:
            raise ValueError(f"{len(per_rank)} ranks (the bridge handles LMDeploy TP size 1)")
        info = per_rank[0]["endpoint_info"]
        info = json.loads(info) if isinstance(info, str) else info
    except (KeyError, IndexError, TypeError, ValueError) as ex:
        raise ValueError(f"{prefill_url} answered no DLMix endpoint info ({ex}); is it started with "
                         "--migration-backend DLMix?") from None
    if not isinstance(info, dict) or info.get("dlmix") != 1 or not isinstance(info.get("transport"), dict) \
            or not isinstance(info.get("layout"), dict):
        raise ValueError(f"{prefill_url} is not a DLMix endpoint (started with --migration-backend DLMix?)")
    if info.get("role") != "Prefill":
        raise ValueError(f"{prefill_url} is an LMDeploy {info.get('role')} engine, not --role Prefill")
    return info


async def lmdeploy_to_vllm(prefill_url: str, decode_url: str, kvp: dict, resp_body: bytes, **_: Any) -> dict:
    """vLLM ``kv_transfer_params`` for a vLLM decode from an LMDeploy prefill's answer (module doc).

    Args: prefill_url/decode_url: the instances' base URLs; kvp: :func:`dlmix.router.engines.lmdeploy.
    kv_transfer_params` of the answer (``remote_block_ids``); resp_body: the answer (its ``usage.prompt_tokens``
    is the number of tokens the held blocks cover).
    Returns ``{"do_remote_prefill": True, "do_remote_decode": False, **TransferParams}``. Raises ValueError.
    """
    tp = await _lmdeploy_params(prefill_url, decode_url, kvp, resp_body)
    return {"do_remote_prefill": True, "do_remote_decode": False, **tp.to_dict()}


async def _lmdeploy_params(prefill_url: str, decode_url: str, kvp: dict, resp_body: bytes) -> TransferParams:
    """The :class:`~dlmix.pd.contract.TransferParams` of an LMDeploy prefill's hold, from its answer (see
    :func:`lmdeploy_to_vllm`). Raises ValueError."""
    try:
        ans = _dec_answer.decode(resp_body)
    except (msgspec.DecodeError, msgspec.ValidationError) as ex:
        raise ValueError(f"LMDeploy prefill answer: {ex}") from None
    if ans.usage is None or ans.usage.prompt_tokens <= 0:
        raise ValueError("LMDeploy prefill answer has no usage.prompt_tokens")
    info = await _lmdeploy_endpoint(prefill_url, decode_url)
    blocks = [int(b) for b in kvp["remote_block_ids"]]
    try:
        return TransferParams.make(engine="lmdeploy", instance_id=prefill_url, transports=[info["transport"]],
                                   request_id=block_ids_transfer_id(blocks), block_ids=blocks,
                                   num_tokens=ans.usage.prompt_tokens, layout=info["layout"])
    except ContractError as ex:
        raise ValueError(f"LMDeploy prefill answer does not make transfer parameters: {ex.reason}") from None


async def _connect_lmdeploy_decode(prefill_url: str, decode_url: str, info: dict) -> None:
    """Connect an LMDeploy decode to a non-LMDeploy prefill whose DLMix endpoint info is ``info`` (``{"dlmix": 1,
    "role": "Prefill", "transport", "layout"}``): LMDeploy's ``p2p_initialize`` then ``p2p_connect`` on the decode,
    the decode's own engine config and ZMQ address standing in for the prefill's (a DLMix decode sends no ZMQ free;
    the core's ``blocks_consumed`` releases the hold). Raises ValueError with the decode's answer, e.g. its pair
    check's reasons."""
    import httpx

    from dlmix.router.engines.lmdeploy import PROTOCOL_TCP

    async with httpx.AsyncClient(timeout=INFO_TIMEOUT_S, trust_env=False) as client:
        cfg = await _call(client, "GET", f"{decode_url}/distserve/engine_info")
        init = await _call(client, "POST", f"{decode_url}/distserve/p2p_initialize", {
            "protocol": PROTOCOL_TCP, "local_engine_id": decode_url, "local_engine_config": cfg,
            "remote_engine_id": prefill_url, "remote_engine_config": cfg})
        await _call(client, "POST", f"{decode_url}/distserve/p2p_connect", {
            "protocol": PROTOCOL_TCP, "remote_engine_id": prefill_url,
            "remote_engine_endpoint_info": init["engine_endpoint_info"],
            "remote_kvtransfer_endpoint_info": [{"protocol": PROTOCOL_TCP, "endpoint_info": json.dumps(info)}]})


async def _to_lmdeploy(prefill_url: str, decode_url: str, p: TransferParams, tok: int) -> dict:
    """LMDeploy's ``migration_request`` for an LMDeploy decode that continues from token ``tok`` after pulling the
    hold ``p`` describes (connecting the decode to that prefill endpoint once). Raises ValueError."""
    if len(p.transports) != 1:
        raise ValueError(f"the prefill has {len(p.transports)} TP ranks; an LMDeploy decode takes TP size 1")
    info = {"dlmix": 1, "role": "Prefill", "transport": p.transports[0], "layout": p.layout}
    key = (prefill_url, decode_url, json.dumps(p.transports[0], sort_keys=True))
    fut = _links.get(key)
    if fut is None or (fut.done() and fut.exception() is not None):
        for old in [k for k in _links if k[:2] == key[:2]]:  # a restarted prefill: connect its new endpoint
            del _links[old]
        fut = _links[key] = asyncio.ensure_future(_connect_lmdeploy_decode(prefill_url, decode_url, info))
    await asyncio.shield(fut)
    from dlmix.router.engines.lmdeploy import PROTOCOL_TCP

    return {"protocol": PROTOCOL_TCP, "remote_engine_id": prefill_url, "remote_session_id": 0,
            "remote_token_id": int(tok), "remote_block_ids": list(p.block_ids), "is_dummy_prefill": False}


async def vllm_to_lmdeploy(prefill_url: str, decode_url: str, kvp: dict, resp_body: bytes, **_: Any) -> dict:
    """LMDeploy's ``migration_request`` for an LMDeploy decode from a vLLM prefill's answer (module doc).

    Args: prefill_url/decode_url: the instances' base URLs; kvp: the prefill's ``kv_transfer_params``
    (:class:`~dlmix.pd.contract.TransferParams`, vLLM's flags); resp_body: the answer (its one token's id in
    ``choices[0].token_ids``).
    Returns ``{"protocol", "remote_engine_id": prefill_url, "remote_session_id": 0, "remote_token_id",
    "remote_block_ids", "is_dummy_prefill": False}``. Raises ValueError (the decode refused the pair, the prefill's
    parameters are not dlmix's, the answer has no token id, the prefill has more than one TP rank).
    """
    p, tok = _vllm_params_and_token(kvp, resp_body)
    if len(p.transports) != 1:
        raise ValueError(f"vLLM prefill has {len(p.transports)} TP ranks; an LMDeploy decode takes TP size 1")
    return await _to_lmdeploy(prefill_url, decode_url, p, tok)


def _vllm_params_and_token(kvp: dict, resp_body: bytes) -> tuple[TransferParams, int]:
    """A vLLM prefill's :class:`~dlmix.pd.contract.TransferParams` and the id of its one token (see
    :func:`vllm_to_lmdeploy`). Raises ValueError."""
    try:
        p = decode_params(kvp)
    except ContractError as ex:
        raise ValueError(f"vLLM prefill's kv_transfer_params: {ex.reason} (is it DLMixConnector?)") from None
    try:
        ans = _dec_vllm.decode(resp_body)
        tok = int(ans.choices[0].token_ids[0])  # type: ignore[index]
    except (msgspec.DecodeError, msgspec.ValidationError, IndexError, TypeError, ValueError) as ex:
        raise ValueError(f"vLLM prefill answer has no choices[0].token_ids ({ex}); the router's prefill leg asks "
                         "for return_token_ids (vLLM >= 0.10.2)") from None
    return p, tok


async def room_handoff(kvp: dict) -> tuple[TransferParams, Optional[int]]:
    """Ask an SGLang prefill's bootstrap server for the hand-off of a room (``POST /dlmix/handoff``, answered once
    the prefill holds the room's KV; ``plugins/sglang/handoff.py``).

    Args: kvp: the SGLang hand-off (``bootstrap_host``, ``bootstrap_port``, ``bootstrap_room``) plus
    ``timeout_s``, how long the prefill may take (seconds), and ``admin_key``, the router's (sent as a bearer token:
    a prefill with ``router_admin_key`` set requires it).
    Returns ``(transfer parameters, first token id or None)``. Raises ValueError with the prefill's reason (the room
    failed there, timed out, the prefill does not run the dlmix backend, an invalid answer).
    """
    import httpx

    from dlmix.pd.contract import decode_room_handoff

    timeout = float(kvp.get("timeout_s") or INFO_TIMEOUT_S)
    host = str(kvp["bootstrap_host"])
    url = f"http://{'[' + host + ']' if ':' in host else host}:{int(kvp['bootstrap_port'])}/dlmix/handoff"
    try:
        async with httpx.AsyncClient(timeout=timeout + 10, trust_env=False) as client:
            key = kvp.get("admin_key")
            r = await client.post(url, json={"room": int(kvp["bootstrap_room"]), "timeout_s": timeout},
                                  headers={"Authorization": f"Bearer {key}"} if key else None)
    except httpx.HTTPError as ex:
        raise ValueError(f"POST {url}: {type(ex).__name__}: {ex}") from None
    if r.status_code == 404:
        raise ValueError(f"{url} not found: the SGLang prefill does not run the dlmix transfer backend "
                         "(--disaggregation-transfer-backend dlmix)")
    if r.status_code != 200:
        raise ValueError(f"SGLang prefill hand-off answered {r.status_code}: {r.text[:500]}")
    try:
        return decode_room_handoff(r.content)
    except ContractError as ex:
        raise ValueError(f"SGLang prefill hand-off: {ex.reason}") from None


async def sglang_to_vllm(prefill_url: str, decode_url: str, kvp: dict, resp_body: bytes, **_: Any) -> dict:
    """vLLM ``kv_transfer_params`` for a vLLM decode from an SGLang prefill (concurrent flow; module doc of
    ``plugins/sglang/handoff.py``): the room's transfer parameters, waited for while the prefill leg runs.

    Args: kvp: the SGLang hand-off plus ``timeout_s`` (:func:`room_handoff`); resp_body: unused (the prefill's
    answer comes only after the decode has read the KV).
    Returns ``{"do_remote_prefill": True, "do_remote_decode": False, **TransferParams}``. Raises ValueError.
    """
    p, _ = await room_handoff(kvp)
    return {"do_remote_prefill": True, "do_remote_decode": False, **p.to_dict()}


async def sglang_to_lmdeploy(prefill_url: str, decode_url: str, kvp: dict, resp_body: bytes, **_: Any) -> dict:
    """LMDeploy's ``migration_request`` for an LMDeploy decode from an SGLang prefill (as :func:`sglang_to_vllm`;
    the decode continues from the prefill's first token, read from its metadata row). Raises ValueError."""
    p, tok = await room_handoff(kvp)
    if tok is None:
        raise ValueError("the SGLang prefill's hand-off carries no first token")
    return await _to_lmdeploy(prefill_url, decode_url, p, tok)


def _to_sglang(decode_url: str, p: TransferParams, tok: int, rooms: Any) -> dict:
    """The bootstrap fields of an SGLang decode leg fed by the hold ``p`` (first token ``tok``): the hand-off filed
    in the router's room table ``rooms`` under a fresh room, and this router's address (:mod:`dlmix.router.rooms`).
    Raises ValueError."""
    from dlmix.pd.contract import RoomHandoff

    if rooms is None:
        raise ValueError("a bridge to an SGLang decode needs the router's room table")
    host, port = rooms.address(decode_url)
    room = rooms.put(RoomHandoff(params=p.to_dict(), first_token_id=int(tok)))
    return {"bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": room}


async def vllm_to_sglang(prefill_url: str, decode_url: str, kvp: dict, resp_body: bytes, *, rooms: Any = None,
                         **_: Any) -> dict:
    """SGLang's bootstrap fields for an SGLang decode from a vLLM prefill's answer (module doc;
    :mod:`dlmix.router.rooms`).

    Args: kvp: the prefill's ``kv_transfer_params`` (:class:`~dlmix.pd.contract.TransferParams`); resp_body: the
    answer (its one token's id in ``choices[0].token_ids``); rooms: the router's room table.
    Returns ``{"bootstrap_host", "bootstrap_port", "bootstrap_room"}`` (this router). Raises ValueError.
    """
    p, tok = _vllm_params_and_token(kvp, resp_body)
    return _to_sglang(decode_url, p, tok, rooms)


async def lmdeploy_to_sglang(prefill_url: str, decode_url: str, kvp: dict, resp_body: bytes, *, rooms: Any = None,
                             **_: Any) -> dict:
    """SGLang's bootstrap fields for an SGLang decode from an LMDeploy prefill's answer (as :func:`vllm_to_sglang`;
    the parameters as :func:`lmdeploy_to_vllm` builds them, the first token from ``remote_token_id``). Raises
    ValueError."""
    p = await _lmdeploy_params(prefill_url, decode_url, kvp, resp_body)
    try:
        tok = int(kvp["remote_token_id"])
    except (KeyError, TypeError, ValueError):
        raise ValueError("LMDeploy prefill answer has no first token (remote_token_ids)") from None
    return _to_sglang(decode_url, p, tok, rooms)


#: ``(prefill engine, decode engine) -> bridge``
BRIDGES: Dict[Tuple[str, str], Bridge] = {
    ("lmdeploy", "vllm"): lmdeploy_to_vllm, ("vllm", "lmdeploy"): vllm_to_lmdeploy,
    ("sglang", "vllm"): sglang_to_vllm, ("sglang", "lmdeploy"): sglang_to_lmdeploy,
    ("vllm", "sglang"): vllm_to_sglang, ("lmdeploy", "sglang"): lmdeploy_to_sglang}


def get_bridge(prefill_engine: str, decode_engine: str) -> Optional[Bridge]:
    """The bridge from ``prefill_engine`` to ``decode_engine`` (engine names), or None when there is none."""
    return BRIDGES.get((prefill_engine, decode_engine))
