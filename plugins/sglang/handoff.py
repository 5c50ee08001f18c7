"""PD from an SGLang prefill to a decode of another engine (vLLM, LMDeploy): the bootstrap route
``POST /dlmix/handoff``.

SGLang's PD flow is concurrent: the prefill runs a room's prompt only once a decode rank has said where it waits
(``META``, :mod:`dlmix_sglang.frames`), and the prefill request finishes only once that decode reports it has read
the KV. A vLLM or LMDeploy decode speaks neither; it takes :class:`dlmix.pd.contract.TransferParams` and pulls. So
the prefill's bootstrap server (:class:`dlmix_sglang.conn.DLMixKVBootstrapServer`, in the prefill's HTTP process)
stands in for the decode's bootstrap side of such a room:

1. the dlmix router sends the prefill leg (with the room) and, at the same time, ``POST /dlmix/handoff``
   ``{"room": R, "timeout_s": T}`` (:class:`dlmix.pd.contract.RoomHandoffRequest`) to the prefill's bootstrap port;
2. :class:`HandoffRelay` sends ``META`` for room R to every prefill attention-TP rank (``aux_index`` None, no decode
   pages: the dlmix prefill never writes into a decode), naming its own ZMQ PULL socket as the decode rank;
3. each rank computes the prompt, holds its pages in the PD core and answers ``READY`` with its transfer
   parameters and its metadata row; the relay answers the HTTP request with one
   :class:`dlmix.pd.contract.RoomHandoff` (rank 0's parameters, every rank's transport in rank order, and the first
   generated token from the ``output_ids`` row);
4. the router gives the parameters to the decode leg; the decode pulls and sends ``blocks_consumed`` to each
   prefill rank, which releases the hold and marks the room ``Success``; then SGLang finishes the prefill request.

A room that fails on the prefill (its status message, ``Failed``) answers 502 with SGLang's reason; no ``READY``
within ``timeout_s`` answers 504 (the router then cancels the prefill leg, and SGLang's abort frees the hold). A
second request for a room already waited on answers 409. With ``router_admin_key`` in the prefill's settings the
route needs that key as a bearer token (the dlmix router sends its ``admin_key``; 401 otherwise); without one it
answers loopback callers only (403 otherwise), like the router's admin API without ``admin_key``. The route moves
no KV and grants nothing: reading the held pages still needs the transport's shared secret
(:mod:`dlmix.pd.endpoint`).
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
from typing import Any, Optional

import msgspec
import zmq
from aiohttp import web

from dlmix.net import is_loopback
from dlmix.pd.contract import ContractError, RoomHandoff, RoomHandoffRequest, decode_params

from .frames import META, READY, STATUS_TAG, TAG

log = logging.getLogger("dlmix_sglang.handoff")

__all__ = ["HandoffRelay", "first_token_id"]

#: SGLang's ``KVPoll.Failed`` (``sglang/srt/disaggregation/base/conn.py``)
_FAILED = 0


def first_token_id(aux: list[bytes]) -> Optional[int]:
    """The first generated token of a prefill's metadata row: element 0 of its first buffer, SGLang's
    ``MetadataBuffers.output_ids`` (int32, ``sglang/srt/disaggregation/utils.py``); None without one."""
    if not aux or len(aux[0]) < 4:
        return None
    return int.from_bytes(aux[0][:4], "little", signed=True)


class _Wait:
    def __init__(self, loop: asyncio.AbstractEventLoop, ranks: int):
        self.loop = loop
        self.fut: asyncio.Future = loop.create_future()
        self.ranks = ranks
        self.ready: dict[int, tuple[dict, list[bytes]]] = {}

    def _set(self, value: Any = None, error: Optional[str] = None) -> None:
        if self.fut.done():
            return
        if error is not None:
            self.fut.set_exception(RuntimeError(error))
        else:
            self.fut.set_result(value)

    def settle(self, value: Any = None, error: Optional[str] = None) -> None:
        """From any thread."""
        self.loop.call_soon_threadsafe(self._set, value, error)


class HandoffRelay:
    """Stands in for the decode side of rooms whose decode runs another engine (module doc). One per bootstrap
    server; its ZMQ PULL socket is bound on first use, on the address rank 0 registered (the bootstrap server runs
    on rank 0's node)."""

    def __init__(self, key: Optional[str] = None) -> None:
        #: bearer key the route requires (the prefill's ``router_admin_key``: the dlmix router sends its admin key);
        #: None: loopback callers only
        self.key = key
        self._lock = threading.Lock()
        self._pull: Optional[zmq.Socket] = None
        self._addr: Optional[tuple[str, int]] = None
        self._push: dict[str, zmq.Socket] = {}
        self._waits: dict[int, _Wait] = {}

    # ------------------------------------------------------------------ socket
    def _ensure(self, ip: str) -> tuple[str, int]:
        with self._lock:
            if self._addr is None:
                ctx = zmq.Context.instance()
                s = ctx.socket(zmq.PULL)
                s.setsockopt(zmq.LINGER, 0)
                s.setsockopt(zmq.MAXMSGSIZE, 64 << 20)
                port = s.bind_to_random_port(f"tcp://{ip}")
                self._pull, self._addr = s, (ip, port)
                threading.Thread(target=self._recv_loop, name="dlmix-sglang-handoff", daemon=True).start()
                log.info("dlmix hand-off relay listening on tcp://%s:%d", ip, port)
            return self._addr

    def _recv_loop(self) -> None:
        assert self._pull is not None
        while True:
            try:
                msg = self._pull.recv_multipart()
                self._on(msg)
            except zmq.ZMQError as e:
                log.warning("dlmix hand-off relay: receive failed: %s", e)
            except Exception as e:  # one bad message must not stop the relay
                log.warning("dlmix hand-off relay: bad message dropped: %s", e)

    def _on(self, msg: list[bytes]) -> None:
        if len(msg) >= 5 and msg[0] == TAG and msg[1] == READY:
            room, rank = int(msg[2]), int(msg[4])
            w = self._waits.get(room)
            if w is None:
                return
            w.ready[rank] = (json.loads(msg[3]), list(msg[5:]))
            if len(w.ready) >= w.ranks:
                w.settle(True)
            return
        if len(msg) >= 4 and msg[0] == STATUS_TAG:
            room, status = int(msg[1]), int(msg[2])
            w = self._waits.get(room)
            if w is not None and status == _FAILED:
                reason = msg[4].decode("utf-8", "replace") if len(msg) > 4 and msg[4] else "no reason given"
                w.settle(error=f"the SGLang prefill failed room {room}: {reason}")
            return
        log.warning("dlmix hand-off relay: unexpected message %r dropped", msg[0][:20] if msg else b"")

    def _send(self, ip: str, port: int, frames: list[bytes]) -> None:
        ep = f"tcp://{ip}:{port}"
        s = self._push.get(ep)
        if s is None:
            s = zmq.Context.instance().socket(zmq.PUSH)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDTIMEO, 5000)
            s.connect(ep)
            self._push[ep] = s
        s.send_multipart(frames)

    # ------------------------------------------------------------------ route
    async def handle(self, server: Any, request: web.Request) -> web.Response:
        """``POST /dlmix/handoff`` on ``server`` (a :class:`dlmix_sglang.conn.DLMixKVBootstrapServer`); see the
        module doc for the answers (and 401 without the bearer ``key`` when one is set)."""
        if self.key and not hmac.compare_digest(request.headers.get("Authorization", "").encode(),
                                                f"Bearer {self.key}".encode()):
            return web.json_response({"error": "the dlmix router's admin key is required"}, status=401)
        if not self.key and not is_loopback(str(request.remote or "")):
            return web.json_response({"error": "without router_admin_key in the prefill's dlmix settings the hand-off "
                                               "route answers loopback callers only (dlmix launch sets the key)"},
                                     status=403)
        try:
            ask = msgspec.json.decode(await request.read(), type=RoomHandoffRequest)
        except (msgspec.ValidationError, msgspec.DecodeError) as e:
            return web.json_response({"error": f"invalid hand-off request: {e}"}, status=400)
        if not server._is_ready():
            return web.json_response({"error": "prefill not fully registered yet"}, status=503)
        ranks = []
        try:
            for tp in range(int(server.attn_tp_size)):
                ranks.append(server.prefill_port_table[0][0][tp][0])
        except (KeyError, TypeError):
            return web.json_response({"error": "prefill has no registered rank table (dp 0, cp 0, pp 0)"},
                                     status=503)
        room = ask.room
        if room in self._waits:
            return web.json_response({"error": f"room {room} is already being handed off"}, status=409)
        ip, port = self._ensure(ranks[0].rank_ip)
        w = self._waits[room] = _Wait(asyncio.get_running_loop(), len(ranks))
        try:
            body = {"required_dst_info_num": 1, "num_pages": 0, "aux_index": None, "decode_prefix_len": 0,
                    "is_dummy": False, "peer": f"dlmix-handoff:{ip}:{port}"}
            meta = [TAG, META, str(room).encode("ascii"), ip.encode("ascii"), str(port).encode("ascii"),
                    json.dumps(body).encode()]
            for r in ranks:
                self._send(r.rank_ip, r.rank_port, meta)
            try:
                await asyncio.wait_for(w.fut, ask.timeout_s)
            except asyncio.TimeoutError:
                return web.json_response({"error": f"room {room}: no KV held within {ask.timeout_s:g} s (the "
                                                   "prefill request did not arrive or did not finish)"}, status=504)
            except RuntimeError as e:
                return web.json_response({"error": str(e)}, status=502)
            try:
                return web.Response(body=msgspec.json.encode(self._answer(w)), content_type="application/json")
            except (ContractError, KeyError, TypeError, ValueError) as e:
                return web.json_response({"error": f"room {room}: the prefill's parameters are invalid: {e}"},
                                         status=502)
        except zmq.ZMQError as e:
            return web.json_response({"error": f"cannot reach the prefill's ranks: {e}"}, status=502)
        finally:
            self._waits.pop(room, None)

    @staticmethod
    def _answer(w: _Wait) -> RoomHandoff:
        """Rank 0's parameters with each rank's own transport (rank order), and the first token."""
        params, aux = w.ready[0]
        transports = [w.ready[r][0]["remote_transports"][0] for r in range(w.ranks)]
        p = decode_params({**params, "remote_transports": transports})
        return RoomHandoff(params=p.to_dict(), first_token_id=first_token_id(aux))
