"""The patches the import hook (:mod:`dlmix_lmdeploy.autoload`) applies to LMDeploy 0.18 modules right after they are
imported. Each one is a no-op for engines that do not select ``--migration-backend DLMix``, except that the name
``DLMix`` becomes a member of LMDeploy's closed ``MigrationBackend`` enum and a choice of its CLI, and that a request
with an empty prompt is answered with an error instead of ending the engine loop.

Where each patch goes, and why (LMDeploy 0.18 sources):

* ``pytorch/disagg/config.py``: ``MigrationBackend`` gains ``DLMix`` (selection is ``MIGRATION_BACKENDS.module_dict[
  backend.name]`` and ``MigrationBackend[args.migration_backend]`` in ``cli/serve.py``);
* ``pytorch/disagg/backend/backend.py``: :class:`dlmix_lmdeploy.backend.DLMixMigrationBackend` registered as ``DLMix``;
* ``cli/utils.py``: ``--migration-backend`` accepts every member of the enum;
* ``pytorch/engine/model_agent/agent.py``: after ``build_cache_engine``, a Prefill/Decode engine with DLMix describes
  its cache and opens its endpoint (an unsupported cache stops the start with the reason);
* ``pytorch/engine/cache_engine/engine.py``: ``p2p_connect`` runs dlmix's pair check instead of
  ``validate_cache_pool_layouts`` (equal pool shapes), which DLMix relaxes;
* ``pytorch/engine/engine_loop.py``: a prefill that keeps its cache becomes a core hold (``_make_infer_outputs``); the
  decode's migration (``_migration_loop_migrate``, which asserts equal block counts) pulls per request through the
  core, and a request whose pull failed is answered with an error instead of decoding from incomplete KV;
* ``pytorch/engine/engine.py``: ``end_session`` of a held prefill session ends the core's hold; the session itself
  ends once no read can touch its blocks; the END/STOP_SESSION requests of a held session leave its sequence as it
  is (LMDeploy would turn it STOPPED, whose blocks its scheduler may evict and reuse during a decode's read); after
  ``__init__``, an engine whose ``DLMIX_LMDEPLOY_CONFIG`` names a ``router_url`` registers with the dlmix router
  and heartbeats its load (:mod:`dlmix_lmdeploy.router_hook`, any migration backend);
* ``pytorch/engine/engine.py`` (any engine): a new request with no prompt token is answered with an input-length
  error; LMDeploy's engine loop asserted on it and ended, and the instance served nothing until restarted;
* ``pytorch/engine/mp_engine/zmq_engine.py``: a start-up race of LMDeploy's engine process fixed for DLMix engines
  (:func:`_mp_engine`);
* ``pytorch/backends/selector.py``: the CPU test aid's op backend, only with ``DLMIX_LMDEPLOY_CPU=1``;
* ``pytorch/paging/block_trie/node.py``: a block attached to / evicted from the prefix-cache trie is published as
  a KV event when ``kv_events_endpoint`` is set (:func:`_trie_node`, :mod:`dlmix_lmdeploy.kv_events`);
* ``serve/core/async_engine.py``: a pair DLMix refuses at ``p2p_connect`` is answered ``409`` with the reasons
  instead of a bare ``500`` (:func:`_async_engine`).
"""
from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

log = logging.getLogger("dlmix_lmdeploy")

__all__ = ["apply", "extend_enum", "is_dlmix", "current", "PATCHES"]

NAME = "DLMix"


def extend_enum(cls: Any, name: str) -> Any:
    """Add member ``name`` to the enum class ``cls`` (value: one above the largest) and return it; idempotent.
    Lookup by name, by value (what unpickling in a spawned process does), iteration and ``__members__`` see it."""
    if name in cls.__members__:
        return cls[name]
    value = max((m.value for m in cls), default=0) + 1
    member = object.__new__(cls)
    member._name_, member._value_ = name, value
    member.__objclass__ = cls
    type.__setattr__(cls, name, member)
    cls._member_map_[name] = member
    cls._value2member_map_[value] = member
    cls._member_names_.append(name)
    return member


def _config(m: Any) -> None:
    extend_enum(m.MigrationBackend, NAME)


def _backend_registry(m: Any) -> None:
    from .backend import DLMixMigrationBackend

    m.MIGRATION_BACKENDS.register_module(NAME, module=DLMixMigrationBackend, force=True)


def _cli(m: Any) -> None:
    def migration_backend(parser):
        from lmdeploy.pytorch.disagg.config import MigrationBackend

        return parser.add_argument("--migration-backend", type=str, default="DLSlime",
                                   choices=[b.name for b in MigrationBackend],
                                   help="kvcache migration management backend when PD disaggregation "
                                        "(DLMix: dlmix's backend, converting block size, dtype and layout)")

    m.ArgumentHelper.migration_backend = staticmethod(migration_backend)


def _wrap(cls: Any, name: str, make: Callable[[Callable], Callable]) -> None:
    original = getattr(cls, name)
    if getattr(original, "__dlmix__", False):
        return
    new = make(original)
    new.__dlmix__ = True
    new.__wrapped__ = original
    setattr(cls, name, new)


def is_dlmix(cache_config: Any) -> bool:
    """True when this engine's cache config selects the DLMix migration backend."""
    return getattr(getattr(cache_config, "migration_backend", None), "name", None) == NAME


_backend: Any = None


def current() -> Any:
    """This process's :class:`dlmix_lmdeploy.backend.Rank`, or None (``backend`` is imported on the first call, not
    at patch time: it imports LMDeploy; called on every engine step, so the module is kept)."""
    global _backend
    if _backend is None:
        from . import backend as _b

        _backend = _b
    return _backend.current()


def _agent(m: Any) -> None:
    def make(original):
        def build_cache_engine(self):
            original(self)
            cc = self.cache_config
            if is_dlmix(cc) and cc.role.name != "Hybrid":
                from .backend import start_rank

                start_rank(self)
        return build_cache_engine

    _wrap(m.BaseModelAgent, "build_cache_engine", make)


def _cache_engine(m: Any) -> None:
    def make(original):
        def p2p_connect(self, remote_engine_id, migration_conn_request):
            if not is_dlmix(self.cache_config):
                return original(self, remote_engine_id, migration_conn_request)
            self.migration_backend_impl.p2p_connect(remote_engine_id, migration_conn_request[self.tp_rank])
        return p2p_connect

    _wrap(m.CacheEngine, "p2p_connect", make)


def _prompt_ids(msg: Any, n: int) -> list[int]:
    return [int(t) for t in msg.all_ids[:n]]


def _engine_loop(m: Any) -> None:
    def make_outputs(original):
        def _make_infer_outputs(self, batched_outputs, running, model_inputs, delta):
            outputs = original(self, batched_outputs, running, model_inputs, delta)
            rank = current()
            if rank is None or rank.role != "Prefill":
                return outputs
            for msg in running:
                out = outputs.get(msg.session_id)
                if out is None or not out.finish or out.cache_block_ids is None:
                    continue
                n = int(msg.num_valid_ids) - int(msg.num_new_tokens)  # the prompt: KV computed, not the new token
                try:
                    rank.hold(self.scheduler, msg.session_id, out.cache_block_ids, _prompt_ids(msg, n))
                except ValueError as e:
                    log.error("DLMix: session %s not held: %s", msg.session_id, e)
            return outputs
        return _make_infer_outputs

    def make_process_ready(original):
        async def _migration_loop_process_ready(self, migration_ready):
            rank = current()
            if not is_dlmix(self.executor.cache_config) or rank is None:
                return await original(self, migration_ready)
            # from now until every pull of this batch is over, their sessions' stop/end wait (Rank.defer): the
            # blocks get_block_tables names below must not be freed before (or while) a pull writes them
            rank.pulling.update(msg.session_id for msg in migration_ready)
            try:
                failed = await _dlmix_migrate(self, migration_ready)
                ok = [msg for msg in migration_ready if msg.session_id not in failed]
                with self.scheduler.seqs_migration_activation(ok):
                    await self._migration_loop_get_outputs(ok)
                for msg in migration_ready:
                    if msg.session_id in failed:
                        _fail(self, msg, failed[msg.session_id])
            finally:
                # a stop/end that came during the pulls runs now, as if it had come just after the migration
                for msg in migration_ready:
                    rank.pull_over(msg.session_id)
            self.has_runable_event.set()
        return _migration_loop_process_ready

    _wrap(m.EngineLoop, "_make_infer_outputs", make_outputs)
    _wrap(m.EngineLoop, "_migration_loop_process_ready", make_process_ready)


_pull_pool: ThreadPoolExecutor | None = None
_pull_pool_lock = threading.Lock()


def _pull_executor(n: int) -> ThreadPoolExecutor:
    """The decode's own pull threads (``pull_threads`` of them, made once). Not the event loop's default executor:
    that one has only ``min(32, cpus + 4)`` threads and LMDeploy's engine needs it too (its multiprocess executor's
    barrier waits, guided decoding), so pulls waiting on a silent prefill must not occupy it."""
    global _pull_pool
    with _pull_pool_lock:
        if _pull_pool is None:
            _pull_pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="dlmix-lmdeploy-pull")
        return _pull_pool


async def _dlmix_migrate(loop: Any, migration_ready: Any) -> dict[int, str]:
    """Pull every ready request's KV through the core (which also releases the prefill's hold), up to
    ``pull_threads`` at once (their connects and grant exchanges overlap, so a prefill that does not answer holds up
    only its own requests; the core has their staging rounds take turns). Returns ``{session_id: reason}`` for the
    requests whose KV did not arrive."""
    rank = current()
    failed: dict[int, str] = {}
    settings = rank.endpoint_settings
    pool = _pull_executor(settings.pull_threads if settings is not None else 1)  # runs pull_threads at a time

    async def one(msg: Any) -> None:
        mr = msg.migration_request
        try:  # one request's failure fails that request only: the batch's other pulls go on
            local = [int(b) for b in loop.scheduler.get_block_tables([msg])[0]]
            ids = _prompt_ids(msg, int(msg.num_all_ids))
            res = await asyncio.get_running_loop().run_in_executor(pool, functools.partial(
                rank.pull, mr.remote_engine_id, mr.remote_session_id, list(mr.remote_block_ids), local, ids))
        except Exception as e:
            failed[msg.session_id] = f"{type(e).__name__}: {e}"
            log.exception("DLMix: session %s not migrated", msg.session_id)
            return
        if res.error is not None:
            failed[msg.session_id] = res.error
            log.error("DLMix: session %s (prefill %s session %s) not migrated: %s", msg.session_id,
                      mr.remote_engine_id, mr.remote_session_id, res.error)
        else:
            log.info("DLMix: session %s migrated %d tokens, %d B in %.3f s", msg.session_id, len(ids),
                     res.bytes_received, res.seconds)

    await asyncio.gather(*(one(msg) for msg in migration_ready if not msg.migration_request.is_dummy_prefill))
    return failed


def _fail(loop: Any, msg: Any, reason: str) -> None:
    """Answer a request whose KV did not arrive with LMDeploy's engine error (its api_server turns it into an error
    answer, not text), and end its session (frees its blocks: no read can touch them any more)."""
    from lmdeploy.messages import ResponseType
    from lmdeploy.pytorch.engine.engine import response_reqs

    response_reqs(loop.req_manager, msg.resp, ResponseType.INTERNAL_ENGINE_ERROR,
                  err_msg=f"DLMix: the prefill's KV did not arrive: {reason}")
    try:
        loop.scheduler.end_session(msg.session_id)
    except Exception as e:  # the session may be gone already
        log.warning("DLMix: ending failed session %s: %s", msg.session_id, e)


def _engine(m: Any) -> None:
    def make(original):
        def end_session(self, session_id):
            rank = current()
            if rank is not None and rank.role == "Prefill":
                if rank.drop(session_id):
                    return True  # ended by the rank's poller once no read can touch the blocks
                if session_id <= -2:  # a hold's alias (the router's free_cache) whose hold ended already: done
                    return True
            return original(self, session_id)
        return end_session

    _wrap(m.Engine, "end_session", make)

    def _held_apart(self, reqs):
        """Split ``reqs`` (STOP/END_SESSION requests) into those naming a session this prefill holds for a decode
        and the rest."""
        rank = current()
        if rank is None or rank.role != "Prefill":
            return [], list(reqs)
        held, rest = [], []
        for req in reqs:
            (held if rank.is_held(int(req.data["session_id"])) else rest).append(req)
        return held, rest

    def _answer(self, reqs):
        from lmdeploy.messages import ResponseType

        for req in reqs:
            if req.data.get("response", True):
                self._response(req.resp, ResponseType.SUCCESS)

    def _defer_pulling(self, original, reqs, kwargs):
        """A decode's stop/end requests naming a session whose pull is writing its blocks are held back until the
        pull is over (:meth:`~dlmix_lmdeploy.backend.Rank.defer`); returns the others."""
        rank = current()
        if rank is None or rank.role != "Decode" or not rank.pulling:
            return list(reqs)
        rest = []
        for req in reqs:
            if not rank.defer(int(req.data["session_id"]), lambda req=req: original(self, [req], **kwargs)):
                rest.append(req)
        return rest

    def make_end(original):
        def _on_end_session(self, reqs, **kwargs):
            reqs = _defer_pulling(self, original, reqs, kwargs)
            # LMDeploy's engine instance ends every session once its request finished; for a prefill that keeps its
            # cache this turns the sequence STOPPED, whose blocks the scheduler may then evict for the next prompt
            # (recompute eviction) while the decode has not read them. A session the rank holds stays as it is
            # (TO_BE_MIGRATED: never evicted) until the hold is released; the rank's poller ends it then.
            held, rest = _held_apart(self, reqs)
            _answer(self, held)
            return original(self, rest, **kwargs) if rest else None
        return _on_end_session

    _wrap(m.Engine, "_on_end_session", make_end)

    def make_stop(original):
        def _on_stop_session(self, reqs, **kwargs):
            reqs = _defer_pulling(self, original, reqs, kwargs)
            # LMDeploy's api_server stops a session whose client went away, also after its prefill finished and
            # kept the blocks for a decode (non-streaming: it looks only once the answer is there): free that hold
            # (at once, or once a read in progress is over; the poller ends the session then). Stopping the
            # sequence here would make its blocks evictable under a read in progress.
            held, rest = _held_apart(self, reqs)
            rank = current()
            for req in held:
                rank.drop(int(req.data["session_id"]))
            _answer(self, held)
            return original(self, rest, **kwargs) if rest else None
        return _on_stop_session

    _wrap(m.Engine, "_on_stop_session", make_stop)

    def make_add(original):
        def _on_add_message(self, reqs, **kwargs):
            # LMDeploy 0.18 asserts ``len(token_ids) > 0`` for a new sequence inside its engine loop
            # (``Engine._add_message``): an empty prompt ended the loop, and the instance served nothing until
            # restarted. Such a request is answered with an input-length error instead (any engine).
            from lmdeploy.messages import ResponseType

            keep = []
            for req in reqs:
                ids = req.data.get("token_ids")
                sess = self.scheduler.get_session(req.data.get("session_id")) if self.scheduler else None
                if ids is not None and len(ids) == 0 and sess is not None and not sess.sequences:
                    self._response(req.resp, ResponseType.INPUT_LENGTH_ERROR)
                else:
                    keep.append(req)
            return original(self, keep, **kwargs) if keep else None
        return _on_add_message

    _wrap(m.Engine, "_on_add_message", make_add)

    def make_init(original):
        def __init__(self, *args, **kwargs):
            original(self, *args, **kwargs)
            from .router_hook import start

            from .config import load_settings
            from .kv_events import start as start_events

            # publishes KV events / registers with the dlmix router when DLMIX_LMDEPLOY_CONFIG asks; else nothing
            settings = load_settings()
            start_events(settings.kv_events_endpoint, int(self.cache_config.block_size))
            start(self, current() if is_dlmix(self.cache_config) else None, settings)
        return __init__

    _wrap(m.Engine, "__init__", make_init)


def _mp_engine(m: Any) -> None:
    """LMDeploy 0.18's ``ZMQMPEngine._start_mp_proc`` leaves its ``with mp.Manager()`` block as soon as the engine
    process has published its RPC port, which shuts the manager down while that process may still be releasing the
    manager's condition: the engine process then dies with ``EOFError`` ("engine process is not alive"), often on a
    busy or single-core host. For engines that select DLMix (or run on the CPU aid) the manager is kept for the
    engine's lifetime instead; everything else is as LMDeploy does it."""
    def make(original):
        def _start_mp_proc(self, model_path, engine_config=None, speculative_config=None, **kwargs):
            mb = getattr(getattr(engine_config, "migration_backend", None), "name", None)
            if mb != NAME and os.environ.get("DLMIX_LMDEPLOY_CPU") != "1":
                return original(self, model_path, engine_config, speculative_config, **kwargs)
            manager = m.mp.Manager()
            self._dlmix_manager = manager  # lives as long as the engine (its process ends with ours)
            shared, cond = manager.dict(), manager.Condition()
            self.shared_dict = shared
            self.mp_ctx = m.mp.get_context("spawn")
            kw = dict(model_path=model_path, engine_config=engine_config, log_level=m.logger.level,
                      speculative_config=speculative_config, **kwargs)
            self.proc = self.mp_ctx.Process(target=self._mp_proc, args=(shared, cond), kwargs=kw,
                                            name="mp_engine_proc")
            self.proc.start()
            with cond:
                while "rpc_server_port" not in shared:
                    if not self.proc.is_alive():
                        raise RuntimeError("PyTorch ZMQ engine process exited before publishing RPC server port.")
                    cond.wait(timeout=1)
            self.port = shared["rpc_server_port"]
        return _start_mp_proc

    _wrap(m.ZMQMPEngine, "_start_mp_proc", make)


def _selector(m: Any) -> None:
    if os.environ.get("DLMIX_LMDEPLOY_CPU") == "1":
        from .cpu import patch_selector

        patch_selector(m)


def _trie_node(m: Any) -> None:
    """Prefix-cache blocks attached to / evicted from LMDeploy's trie become KV events for the router when
    ``kv_events_endpoint`` is set (:mod:`dlmix_lmdeploy.kv_events`); otherwise the methods run as they are."""
    def make_attach(original):
        def attach_to(self, parent):
            original(self, parent)
            pub = _events()
            if pub is not None:
                pub.stored(self)
        return attach_to

    def make_detach(original):
        def detach_leaf(self):
            done = original(self)
            pub = _events()
            if done and pub is not None:
                pub.removed(self)
            return done
        return detach_leaf

    _wrap(m.Node, "attach_to", make_attach)
    _wrap(m.Node, "detach_leaf", make_detach)


def _events() -> Any:
    from .kv_events import current as events

    return events()


def _async_engine(m: Any) -> None:
    """A pair DLMix refuses (``p2p_connect``'s pair check, in the engine process) reaches the api_server as a bare
    ``Exception`` with the reasons (LMDeploy's MP engine RPC, ``mp_engine/zmq_rpc.py``), which FastAPI answers as
    ``500 Internal Server Error`` without them; answer ``409`` with the reasons instead, so whoever connects the pair
    (the dlmix router, LMDeploy's proxy) can say why. Other errors are left as they are."""
    def make(original):
        def p2p_connect(self, conn_request):
            try:
                return original(self, conn_request)
            except Exception as e:
                if "DLMix:" not in str(e):
                    raise
                from fastapi import HTTPException

                raise HTTPException(status_code=409, detail=str(e)) from None
        return p2p_connect

    _wrap(m.AsyncEngine, "p2p_connect", make)


PATCHES: dict[str, Callable[[Any], None]] = {
    "lmdeploy.pytorch.disagg.config": _config,
    "lmdeploy.pytorch.disagg.backend.backend": _backend_registry,
    "lmdeploy.cli.utils": _cli,
    "lmdeploy.pytorch.engine.model_agent.agent": _agent,
    "lmdeploy.pytorch.engine.cache_engine.engine": _cache_engine,
    "lmdeploy.pytorch.engine.engine_loop": _engine_loop,
    "lmdeploy.pytorch.engine.engine": _engine,
    "lmdeploy.pytorch.backends.selector": _selector,
    "lmdeploy.pytorch.engine.mp_engine.zmq_engine": _mp_engine,
    "lmdeploy.serve.core.async_engine": _async_engine,
    "lmdeploy.pytorch.paging.block_trie.node": _trie_node,
}


def apply(name: str, module: Any) -> None:
    """Run the patch of module ``name`` (see module doc). A patch that fails is logged and leaves LMDeploy as it is,
    except for DLMix itself, whose engines then stop at start-up with the error."""
    patch = PATCHES.get(name)
    if patch is None:
        return
    try:
        patch(module)
    except Exception as e:
        log.error("dlmix_lmdeploy: patching %s failed: %s", name, e)
        if os.environ.get("DLMIX_LMDEPLOY_STRICT") == "1":
            raise
