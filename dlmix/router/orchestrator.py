"""PD orchestration: the prefill leg of a disaggregated request, its retries and its fallback.

Two flows, by the engine adapter's ``PD_FLOW`` (:mod:`dlmix.router.engines.base`): *sequential* (vLLM,
:meth:`PDOrchestrator.prefill`, below) and *concurrent* (SGLang, :meth:`PDOrchestrator.concurrent`: both legs at
once, joined by a bootstrap hand-off; a failed prefill leg cancels the decode leg and is placed again by the policy,
a failed decode leg or a client that goes away cancels the prefill leg).

Sequential flow:
For a decision with a prefill instance P and a decode instance D, :meth:`PDOrchestrator.prefill` sends P the engine
adapter's prefill request (:func:`dlmix.router.engines.get_engine` ``.prefill_body``) and returns the
``kv_transfer_params`` the decode leg carries to D. When the leg fails (connection error, timeout after
``prefill_timeout_s``, 5xx, a response without ``kv_transfer_params``), the *policy* places it again: it is asked to
choose over the prefill instances not tried yet plus D (so D stays the decode instance); its choice of a prefill
instance is tried next, its choice of no prefill instance (or no choice at all) means a full prefill on D. At most
``retries`` other prefill instances are tried. A 4xx from P is the client's error and goes to the client as it is.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Callable, NamedTuple, Optional

from dlmix.router.bodies import n_choices
from dlmix.router.engines.bridges import get_bridge
from dlmix.router.proxy import BackendError, build_request, error_body, request
from dlmix.routing.policies import prefill_work
from dlmix.routing.state import Decision, InstanceState, NoInstanceError, RouteRequest

__all__ = ["PDOrchestrator", "Handoff", "SENT"]

log = logging.getLogger("dlmix.router.pd")

#: seconds a concurrent-flow prefill leg's 5xx waits for its decode leg's own answer before the prefill is placed
#: again (:meth:`PDOrchestrator.prefill`): the decode's refusal of the pair carries the reasons
DECODE_ANSWER_GRACE_S = 1.0

#: returned by :meth:`PDOrchestrator.prefill` when the prefill instance's 4xx answer was sent to the client
SENT = object()


def _excerpt(body: bytes, limit: int = 200) -> str:
    """``body`` (an engine's answer) as one line of at most ``limit`` characters, for an error message."""
    text = " ".join(bytes(body or b"").decode("utf-8", "replace").split())
    return text if len(text) <= limit else text[:limit] + "..."


def _cancel(t: asyncio.Future) -> None:
    """Cancel leg task ``t`` if it still runs, and retrieve how it ends (a cancelled request can still end with its
    BackendError: no "Task exception was never retrieved" in the log)."""
    if t.done():
        if not t.cancelled():
            t.exception()
        return
    t.cancel()
    t.add_done_callback(lambda f: f.cancelled() or f.exception())

class Handoff(NamedTuple):
    """A finished prefill leg: ``kvp``, what the decode leg carries (in the decode engine's terms, through a bridge
    across engines); ``abort``, a call that frees what the prefill holds for the request (None when its engine
    adapter has no ``abort_handoff``), for when the decode leg does not take it."""

    kvp: dict
    abort: Optional[Callable[[], None]]


async def _no_bridge(prefill_url: str, decode_url: str, kvp: dict, rbody: bytes) -> dict:
    raise ValueError("their engines' PD flows differ and no bridge joins them")


class PDOrchestrator:
    """Runs prefill legs over the registry's backends.

    Args:
        registry: :class:`~dlmix.router.registry.Registry` (backends, breaker bookkeeping).
        policy: the routing policy (re-places a failed prefill leg).
        cfg: router config (``prefill_timeout_s``, ``retries``).
        metrics: :class:`~dlmix.router.metrics.Metrics` or None.
        make_view: ``instances -> ClusterView`` (the router's indexes and cost model).
        rooms: the router's :class:`~dlmix.router.rooms.RoomTable` (bridges to an SGLang decode file their
            hand-offs there); None: such bridges answer 502.
    """

    def __init__(self, registry, policy, cfg, metrics, make_view: Callable, rooms=None):
        self.registry = registry
        self.policy = policy
        self.cfg = cfg
        self.metrics = metrics
        self.make_view = make_view
        self.rooms = rooms
        self._aborts: set = set()  # running abort_handoff tasks (kept referenced until done)

    async def prefill(self, conn, req, d: dict, rr: RouteRequest, dec: Decision, chat: bool, fwd: bytes):
        """Run the prefill leg of ``dec`` (``d``: the parsed client body; ``fwd``: forwarded header lines).

        Returns a :class:`Handoff` (the decode leg's ``kvp``, and the call that frees the prefill's hold when the
        decode leg does not take it); None when the prefill moved to the decode instance (``dec.prefill`` is None
        then); :data:`SENT` when a 4xx from the prefill instance or a pair that cannot work (502) was answered to
        the client. Raises BackendError only when the client went away. ``dec`` and the instances' load counters
        are updated as the leg moves.
        """
        p = dec.prefill
        body = self.registry.backends[p.id].engine.prefill_body(d, chat)
        tried = {p.id}
        m = self.metrics
        while True:
            b = self.registry.backends.get(p.id)
            if b is not None:
                raw = build_request(b"POST", req.url, b.hostport, b.auth + fwd, body)
                try:
                    c = await request(b.pool, raw, None, conn, self.cfg.prefill_timeout_s)
                    status, hdrs, rbody = c.collected()
                    if status == 200:
                        kvp = b.engine.kv_transfer_params(rbody)
                        b.fails = 0
                        if m:
                            m.prefill_leg(b, status, kvp)
                        return await self._pair_ready(conn, b, dec, kvp, rbody)
                    if m:
                        m.prefill_leg(b, status)
                    if 400 <= status < 500:
                        return self._client_error(conn, c)
                    self.registry.fail(b)
                    why = f"prefill instance {p.id} answered {status}: {_excerpt(rbody)}"
                except BackendError as ex:
                    if m:
                        m.prefill_leg(b)
                    if conn.closed:
                        raise
                    self.registry.fail(b, ex)
                    why = f"prefill instance {p.id} failed: {ex}"
                except ValueError:  # 200 without kv_transfer_params
                    if m:
                        m.prefill_leg(b)
                    self.registry.fail(b)
                    why = f"prefill instance {p.id} answered 200 without transfer parameters"
            else:
                why = f"prefill instance {p.id} was removed"
            if not self._place_again(rr, dec, tried, why):
                return None
            p = dec.prefill
            tried.add(p.id)

    def _client_error(self, conn, c):
        """Send a prefill instance's 4xx answer ``c`` (the client's error) to the client as it is; :data:`SENT`."""
        status, hdrs, rbody = c.collected()
        ctype = next((v for k, v in hdrs if k == b"content-type"), b"application/json")
        if self.metrics:
            self.metrics.answer(status)
        conn.send(status, rbody, ctype)
        return SENT

    def handoff_abort(self, b, kvp: dict):
        """A callable that tells prefill backend ``b`` to free the KV it holds for this request (its engine
        adapter's optional ``abort_handoff`` with ``kvp`` as ``b`` answered it, i.e. in the prefill engine's terms,
        also when a bridge gave the decode leg another engine's; run as a background task, errors logged), for when
        the decode leg did not take it; None when the engine has no such hook (its prefill's hold timeout frees
        the KV)."""
        hook = getattr(b.engine, "abort_handoff", None)
        if hook is None:
            return None
        url = b.state.url

        def abort() -> None:
            task = asyncio.ensure_future(hook(url, kvp))
            self._aborts.add(task)
            task.add_done_callback(self._aborts.discard)
        return abort

    async def _pair_ready(self, conn, b, dec: Decision, kvp: dict, rbody: bytes):
        """Make the prefill's hand-off fit the decode instance before the decode leg: across engines, the bridge
        between them (:mod:`dlmix.router.engines.bridges`, given the router's room table); otherwise the engine
        adapter's optional ``pair_ready`` (e.g. LMDeploy's connection handshake). Returns the :class:`Handoff`, or
        :data:`SENT` after answering 502 with the reason when the pair cannot work (the prefill's hold is freed
        then)."""
        abort = self.handoff_abort(b, kvp)
        db = self.registry.backends.get(dec.decode.id)
        if db is None:
            return Handoff(kvp, abort)
        if db.engine is not b.engine:
            ready = get_bridge(b.engine.NAME, db.engine.NAME)
            if ready is None:  # registration refuses such pairs; a guard, not a path
                ready = _no_bridge
            call = ready(b.state.url, db.state.url, kvp, rbody, rooms=self.rooms)
        else:
            ready = getattr(b.engine, "pair_ready", None)
            if ready is None:
                return Handoff(kvp, abort)
            call = ready(b.state.url, db.state.url, kvp)
        try:
            return Handoff(await call, abort)
        except Exception as ex:  # ValueError by contract; a malformed engine answer may raise KeyError/TypeError
            if abort is not None:
                abort()
            if self.metrics:
                self.metrics.answer(502)
            if isinstance(ex, ValueError):
                why = str(ex)
            else:  # an engine answer of an unexpected shape, or a bug here: keep the traceback in the log
                log.warning("pair hand-off %s -> %s failed", b.state.id, db.state.id, exc_info=ex)
                why = f"{type(ex).__name__}: {ex}"
            conn.send(502, error_body(502, f"prefill {b.state.id} cannot feed decode {db.state.id}: {why}"))
            return SENT
        except BaseException:  # cancelled (the client went away): the decode leg will never take the hold
            if abort is not None:
                abort()
            raise

    async def concurrent(self, conn, req, d: dict, rr: RouteRequest, dec: Decision, chat: bool, fwd: bytes,
                         first: Callable[[], None]):
        """Run both legs of ``dec`` at once (concurrent PD flow): the hand-off (the prefill instance's bootstrap host,
        port and a fresh room) goes into both; the decode leg streams to the client.

        Returns ``(decode backend, its proxy.Answer)`` when the decode leg finished; :data:`SENT` when the prefill
        instance's 4xx answer went to the client (the decode leg is cancelled). A prefill leg that fails (connection
        error, timeout after ``prefill_timeout_s``, 5xx) before the decode leg sent anything cancels the decode leg
        and is placed again by the policy (at most ``retries`` other prefill instances, each with a new room).
        Raises BackendError: from the decode leg (``.prefill_failed`` False: the decode instance is to blame), or,
        with ``.prefill_failed`` True, when no prefill instance could serve the request. Cancelling this coroutine
        (client gone) cancels both legs.
        """
        m = self.metrics
        tried: set = set()
        last: Optional[str] = None
        while True:
            p = dec.prefill
            tried.add(p.id)
            db = self.registry.backends.get(dec.decode.id)
            if db is None:
                raise BackendError(f"instance {dec.decode.id} was removed")
            pb = self.registry.backends.get(p.id)
            if pb is None or pb.bootstrap is None:
                last = f"prefill instance {p.id} was removed" if pb is None else f"{p.id} has no bootstrap_port"
            else:
                kvp = pb.engine.handoff(*pb.bootstrap)
                praw = build_request(b"POST", req.url, pb.hostport, pb.auth + fwd, pb.engine.prefill_body(d, chat, kvp))
                draw = build_request(req.method, req.url, db.hostport, db.auth + fwd,
                                     db.engine.decode_body(req.body, kvp, d))
                started = [False]

                def on_first(_s=started):
                    _s[0] = True
                    first()
                # not registered on the client's connection: the leg outlives the client's answer (SGLang answers
                # it once the decode has read the KV); a client gone before that cancels it here or through
                # Handoff.abort, never after the answer
                ptask = asyncio.ensure_future(request(pb.pool, praw, None, None, self.cfg.prefill_timeout_s))
                dtask = asyncio.ensure_future(request(db.pool, draw, conn.transport, conn, None, on_first))
                try:
                    await asyncio.wait((ptask, dtask), return_when=asyncio.FIRST_COMPLETED)
                    if not ptask.done():  # the decode leg ended first
                        if dtask.exception() is not None:
                            raise dtask.exception()  # (the prefill leg is cancelled below)
                        if dtask.result().status != 200:  # its answer went to the client; the prefill is moot
                            return db, dtask.result()
                        await asyncio.wait((ptask,))  # the KV is home: the prefill's answer follows
                    perr = ptask.exception()
                    pstatus = None if perr is not None else ptask.result().status
                    if m:
                        m.prefill_leg(pb, pstatus or 0)
                    if pstatus == 200 or started[0] or dtask.done():
                        if pstatus == 200:
                            pb.fails = 0
                        elif not (conn.closed or conn.transport.is_closing()):
                            self.registry.fail(pb, perr)
                        c = await dtask  # raises the decode leg's BackendError
                        return db, c
                    if pstatus is not None and pstatus >= 500:
                        # a decode that refused the room (an incompatible pair: other model or weights) aborts the
                        # prefill's room, whose 5xx then often comes first; the decode's own answer, with the
                        # reasons, follows within milliseconds and goes to the client as it would had it come first
                        await asyncio.wait((dtask,), timeout=DECODE_ANSWER_GRACE_S)
                        if dtask.done() and not dtask.cancelled() and dtask.exception() is None \
                                and dtask.result().status != 200:
                            return db, dtask.result()
                    dtask.cancel()
                    if pstatus is not None and 400 <= pstatus < 500:
                        return self._client_error(conn, ptask.result())
                    if conn.closed:
                        raise perr or BackendError("client went away")
                    self.registry.fail(pb, perr)
                    last = str(perr) if perr is not None else f"prefill instance {p.id} answered {pstatus}"
                finally:
                    for t in (ptask, dtask):
                        _cancel(t)
            alt = self.replace(rr, dec, tried) if len(tried) <= self.cfg.retries else None
            if alt is None:
                raise BackendError(f"no prefill instance could serve the request (last: {last})", prefill_failed=True)
            self.move(dec, rr, alt.prefill, alt.hit_tokens, alt.predicted_ttft)
            if m:
                m.retry("prefill")

    async def bridged(self, conn, req, d: dict, rr: RouteRequest, dec: Decision, chat: bool, fwd: bytes):
        """The prefill leg of ``dec`` when a concurrent-flow prefill (SGLang) feeds a sequential-flow decode of
        another engine (vLLM, LMDeploy) through a bridge (:mod:`dlmix.router.engines.bridges`): the prefill leg
        (with a fresh bootstrap room) and the bridge (which waits for the room's transfer parameters) start
        together; the prefill's own answer comes only after the decode has read the KV, so the leg keeps running in
        the background (its end is counted in the metrics; a prefill that fails then is the decode leg's problem,
        which falls back to computing the prompt).

        Returns a :class:`Handoff` whose ``abort`` cancels the prefill leg (SGLang then aborts the request and its
        dlmix backend frees the hold once no read can touch it); None when the prefill moved to the decode
        instance; :data:`SENT` when the prefill instance's 4xx answer went to the client. A failed leg or bridge
        (connection error, timeout after ``prefill_timeout_s``, 5xx, the prefill failed the room, the pair was
        refused) is placed again by the policy, as in :meth:`prefill`. Raises BackendError only when the client
        went away.

        A request for ``n > 1`` choices has its prefill leg sent with ``n=1``: for ``n > 1`` SGLang runs a prefix
        warm-up request and then the ``n`` choices, all under the request's one room
        (``sglang/srt/managers/tokenizer_manager.py`` ``_handle_batch_request``), while one hand-off serves the room
        once; the decode engine fans out into the ``n`` choices, each pulling the one hold."""
        m = self.metrics
        tried: set = set()
        if n_choices(d) > 1:
            d = {**d, "n": 1}  # the prefill leg's body only; the decode leg keeps the client's bytes
        while True:
            p = dec.prefill
            tried.add(p.id)
            pb = self.registry.backends.get(p.id)
            db = self.registry.backends.get(dec.decode.id)
            if pb is not None and pb.engine.PD_FLOW != "concurrent":  # re-placed on a sequential-flow prefill
                return await self.prefill(conn, req, d, rr, dec, chat, fwd)
            if pb is not None and db is not None and pb.bootstrap is not None:
                kvp = pb.engine.handoff(*pb.bootstrap)
                praw = build_request(b"POST", req.url, pb.hostport, pb.auth + fwd, pb.engine.prefill_body(d, chat, kvp))
                bridge = get_bridge(pb.engine.NAME, db.engine.NAME) or _no_bridge
                # not registered on the client's connection: the leg outlives the client's answer (SGLang answers
                # it once the decode has read the KV); a client gone before that cancels it here or through
                # Handoff.abort, never after the answer
                ptask = asyncio.ensure_future(request(pb.pool, praw, None, None, self.cfg.prefill_timeout_s))
                htask = asyncio.ensure_future(bridge(pb.state.url, db.state.url,
                                                     {**kvp, "timeout_s": self.cfg.prefill_timeout_s,
                                                      "admin_key": self.cfg.admin_key}, b"", rooms=self.rooms))
                try:
                    await asyncio.wait((ptask, htask), return_when=asyncio.FIRST_COMPLETED)
                except BaseException:
                    _cancel(ptask)
                    _cancel(htask)
                    raise
                if htask.done() and not htask.cancelled() and htask.exception() is None:
                    out = htask.result()
                    ptask.add_done_callback(lambda t, b=pb, k=out: self._leg_ended(b, t, k))
                    return Handoff(out, ptask.cancel)
                try:
                    if not htask.done():  # the prefill leg ended first: it never held the room's KV
                        htask.cancel()
                        await asyncio.wait((htask,))
                    else:
                        ptask.cancel()
                        await asyncio.wait((ptask,))
                except BaseException:  # cancelled meanwhile (client gone): the leg that ended is retrieved too
                    _cancel(ptask)
                    _cancel(htask)
                    raise
                self._retrieve(ptask, htask)
                perr = None if ptask.cancelled() else ptask.exception()
                pstatus = None if ptask.cancelled() or perr is not None else ptask.result().status
                if m:
                    m.prefill_leg(pb, pstatus or 0)
                if pstatus is not None and 400 <= pstatus < 500:
                    return self._client_error(conn, ptask.result())
                if conn.closed:
                    raise perr or BackendError("client went away")
                if perr is not None or (pstatus or 0) >= 500:  # a refused pair is not the prefill's fault
                    self.registry.fail(pb, perr)
                herr = None if htask.cancelled() else htask.exception()
                if herr is not None:
                    log.warning("prefill %s -> decode %s: %s", p.id, dec.decode.id, herr)
                why = (f"prefill instance {p.id} failed: {herr or perr}" if (herr or perr) is not None
                       else f"prefill instance {p.id} answered {pstatus}")
            else:
                why = f"prefill instance {p.id} was removed"
            if not self._place_again(rr, dec, tried, why):
                return None

    def _place_again(self, rr: RouteRequest, dec: Decision, tried: set, why: str = "") -> bool:
        """After a failed prefill leg of ``dec`` (``why``: what failed, one line): the policy's next prefill
        instance (:meth:`replace`, at most ``retries`` tried) takes it, or, with none, the decode instance prefills
        itself (``dec.prefill_failure`` = ``why`` then, for the answer when it cannot). Returns False in that last
        case. Counts the retry."""
        alt = self.replace(rr, dec, tried) if len(tried) <= self.cfg.retries else None
        if alt is None:
            self.move(dec, rr, None)
            dec.prefill_failure = why
            if self.metrics:
                self.metrics.retry("prefill_local")
            return False
        self.move(dec, rr, alt.prefill, alt.hit_tokens, alt.predicted_ttft)
        if self.metrics:
            self.metrics.retry("prefill")
        return True

    def _leg_ended(self, b, task: asyncio.Future, kvp: dict) -> None:
        """A bridged prefill leg that ran on in the background ended: count it (its exception retrieved), with the
        blocks ``kvp`` (the hand-off the decode got) names as handed off when it succeeded."""
        if task.cancelled():
            status = 0
        else:
            status = 0 if task.exception() is not None else task.result().status
        if self.metrics:
            self.metrics.prefill_leg(b, status, kvp if status == 200 else None)
        if status == 200:
            b.fails = 0

    @staticmethod
    def _retrieve(*tasks: asyncio.Future) -> None:
        for t in tasks:
            if t.done() and not t.cancelled():
                t.exception()  # retrieved: no "never retrieved" warning

    def replace(self, rr: RouteRequest, dec: Decision, tried: set) -> Optional[Decision]:
        """Ask the policy where the prefill of ``rr`` goes now: it chooses over the untried prefill-role instances
        and ``dec.decode``. Returns its decision when it names an untried prefill instance and keeps the decode
        instance, else None (prefill on the decode instance)."""
        d = dec.decode
        insts = [i for i in self.registry.instances if (i.role == "prefill" and i.id not in tried) or i is d]
        if len(insts) < 2:
            return None
        try:
            alt = self.policy.choose(rr, self.make_view(insts))
        except NoInstanceError:
            return None
        if alt.prefill is None or alt.prefill.id in tried or alt.decode is not d:
            return None
        return alt

    @staticmethod
    def move(dec: Decision, rr: RouteRequest, new: Optional[InstanceState], hit_tokens: Optional[int] = None,
             predicted_ttft: Optional[float] = None) -> None:
        """Re-assign the prefill leg of ``dec`` to ``new`` (None: the decode instance), moving its queued prefill
        work (tokens, see :func:`dlmix.routing.policies.prefill_work`) with it; ``hit_tokens``/``predicted_ttft``
        are the new placement's (kept when None)."""
        old = dec.prefill.load
        old.inflight = max(old.inflight - 1, 0)
        old.unqueue_prefill(*prefill_work(dec, rr))
        if hit_tokens is not None:
            dec.hit_tokens = hit_tokens
        if predicted_ttft is not None:
            dec.predicted_ttft = predicted_ttft
        work = prefill_work(dec, rr)
        if new is None:
            dec.decode.load.queue_prefill(*work)
        else:
            new.load.inflight += 1
            new.load.processed += 1
            new.load.queue_prefill(*work)
        dec.prefill = new
