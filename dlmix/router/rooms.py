"""Bootstrap rooms the router hands to an SGLang decode that a prefill of another engine (vLLM, LMDeploy) feeds.

An SGLang decode learns of its KV only through a bootstrap room: it asks the prefill's bootstrap server where the
room's KV is (``sglang/srt/disaggregation/common/conn.py``). A vLLM or LMDeploy prefill has no bootstrap server, but
its answer (through the router) holds everything the decode needs: the :class:`dlmix.pd.contract.TransferParams` of
its hold and its first generated token. So the router stands in for the prefill's bootstrap side of such a room:

1. the prefill leg runs first (sequential flow); the bridge (:mod:`dlmix.router.engines.bridges`, ``vllm -> sglang``
   and ``lmdeploy -> sglang``) files the hand-off here under a fresh random 63-bit room (:meth:`RoomTable.put`) and
   gives the decode leg the bootstrap fields ``bootstrap_host``/``bootstrap_port`` (this router, :meth:`RoomTable.
   address`) and ``bootstrap_room``;
2. the dlmix SGLang backend on the decode sees that the bootstrap address is a dlmix router (``GET /dlmix/layout``
   answers ``{"dlmix_router": true}``), asks ``POST /dlmix/handoff`` ``{"room": R}``
   (:class:`dlmix.pd.contract.RoomHandoffRequest`) and gets the :class:`dlmix.pd.contract.RoomHandoff`; it pulls the
   KV from the prefill's transport endpoint (converted on the way) and continues from the first token.

The same route and answer as an SGLang prefill's bootstrap server gives a decode of another engine
(``plugins/sglang/handoff.py``), in the other direction. The route needs the router's admin key, as registration does
(the decode's ``router_admin_key``; loopback peers need none while the router has no ``admin_key``). A room is a
63-bit random number known only to the router and the decode leg, and the answer grants nothing by itself (reading
the held blocks needs the transport's shared secret, :mod:`dlmix.pd.endpoint`). Entries expire after ``ttl_s``
seconds (the prefill's hold has expired by then anyway) and the table keeps at most ``capacity`` rooms (the oldest go
first).
"""
from __future__ import annotations

import collections
import ipaddress
import random
import socket
import time
from typing import Optional
from urllib.parse import urlsplit

from dlmix.pd.contract import RoomHandoff

__all__ = ["RoomTable"]

_rng = random.SystemRandom()


class RoomTable:
    """Room -> :class:`~dlmix.pd.contract.RoomHandoff`, with expiry (see module doc).

    Args:
        cfg: the router's config; ``handoff_host`` (or ``host``) and ``port`` are read at each :meth:`address`
            (the port is known only once the router listens).
        ttl_s: seconds a room stays answerable.
        capacity: rooms kept at most.
    """

    def __init__(self, cfg, ttl_s: float = 600.0, capacity: int = 65536):
        self.cfg = cfg
        self.ttl_s = float(ttl_s)
        self.capacity = int(capacity)
        self._rooms: "collections.OrderedDict[int, tuple[float, RoomHandoff]]" = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._rooms)

    def put(self, handoff: RoomHandoff, now: Optional[float] = None) -> int:
        """File ``handoff`` under a fresh random room, a 63-bit int above 0 (SGLang reads room 0 as "no metadata
        written"); returns the room."""
        now = time.monotonic() if now is None else now
        self._expire(now)
        room = 0
        while room == 0 or room in self._rooms:
            room = _rng.getrandbits(63)
        self._rooms[room] = (now + self.ttl_s, handoff)
        while len(self._rooms) > self.capacity:
            self._rooms.popitem(last=False)
        return room

    def get(self, room: int, now: Optional[float] = None) -> Optional[RoomHandoff]:
        """The hand-off filed under ``room``; None when unknown or expired. Every TP rank of the decode asks, so an
        answer does not remove the room."""
        self._expire(time.monotonic() if now is None else now)
        hit = self._rooms.get(room)
        return None if hit is None else hit[1]

    def _expire(self, now: float) -> None:
        rooms = self._rooms
        while rooms:
            room, (until, _) = next(iter(rooms.items()))
            if until > now:
                break
            del rooms[room]

    def address(self, decode_url: str) -> tuple[str, int]:
        """``(host, port)`` at which the decode instance at ``decode_url`` reaches this router: ``handoff_host`` when
        configured, else ``host`` unless that is a wildcard (``0.0.0.0``, ``::``, empty), else the local address of
        this machine's route to the decode's host (no packet is sent). Raises ValueError when none is found."""
        host = getattr(self.cfg, "handoff_host", None) or self.cfg.host
        port = int(self.cfg.port)
        if host and not _wildcard(host):
            return host, port
        target = urlsplit(decode_url).hostname or "127.0.0.1"
        try:
            fam = socket.AF_INET6 if ":" in target else socket.AF_INET
            with socket.socket(fam, socket.SOCK_DGRAM) as s:
                s.connect((target, 9))
                return s.getsockname()[0], port
        except OSError as ex:
            raise ValueError(f"cannot tell the address the decode {decode_url} reaches this router at ({ex}); "
                             "set the router's handoff_host") from None


def _wildcard(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False
