"""Registration and heartbeats of one engine instance with the dlmix router, from a daemon thread; every engine
adapter uses it (the vLLM connector's scheduler side, the SGLang scheduler hook).

Contract (the router's admin API, :mod:`dlmix.router.admin`):

* ``POST {router}/admin/instances`` with the body of :func:`dlmix.pd.registration.registration_body` ->
  ``201 {"id"}``; any other answer (``409`` = a layout or PD flow the registered instances cannot pair with, ``400`` =
  a bad field) is logged with the router's reason and retried slowly (``5 x heartbeat_s``, at least 5 s).
* ``POST {router}/admin/instances/{id}/heartbeat`` with ``{"waiting", "running", "kv_usage"}`` (requests, requests,
  fraction 0..1) every ``heartbeat_s`` seconds; ``404`` (the router restarted or expired the instance) -> register
  again, at once the first time and after ``heartbeat_s`` while the fresh registration's heartbeats keep getting
  ``404``.

``Authorization: Bearer <admin_key>`` is sent when a key is given. The engine's own loop never waits on the network:
the body and the load figures are read through callables, without locks (approximate by design).
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable

log = logging.getLogger("dlmix.pd.router_client")

__all__ = ["RouterClient"]


class RouterClient:
    """Registers an instance with the router and heartbeats its load, from a daemon thread.

    Args:
      router_url: ``http://host:port`` of the dlmix router.
      body: callable returning the registration body (called at each (re-)registration, so late facts such as the
        transport descriptor of a worker that finished its handshake are included); it may raise, which is logged
        and retried.
      load: callable returning ``{"waiting": int, "running": int, "kv_usage": float | None}``.
      heartbeat_s: seconds between heartbeats.
      admin_key: the router's admin key, or None.
      first_wait_s: seconds to wait before the first registration (let the engine finish starting).

    Attributes: ``instance_id`` (None until registered), ``registered`` (a threading.Event), ``last_error``,
    ``heartbeats`` (heartbeats the router accepted).
    """

    def __init__(self, router_url: str, body: Callable[[], dict[str, Any]], load: Callable[[], dict[str, Any]],
                 heartbeat_s: float = 2.0, admin_key: str | None = None, first_wait_s: float | None = None):
        self.base = str(router_url).rstrip("/")
        self.body = body
        self.load = load
        self.heartbeat_s = float(heartbeat_s)
        self.admin_key = admin_key
        self.first_wait_s = min(5.0, self.heartbeat_s) if first_wait_s is None else float(first_wait_s)
        self.instance_id: str | None = None
        self.registered = threading.Event()
        self.last_error: str | None = None
        self.heartbeats = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dlmix-router-client", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        import httpx

        self._stop.wait(self.first_wait_s)
        headers = {"Authorization": f"Bearer {self.admin_key}"} if self.admin_key else {}
        lost_in_a_row = 0  # heartbeats answered 404 since the last accepted one
        with httpx.Client(timeout=5.0, headers=headers) as http:
            while not self._stop.is_set():
                try:
                    if self.instance_id is None:
                        body = self.body()
                        r = http.post(f"{self.base}/admin/instances", json=body)
                        if r.status_code in (200, 201):
                            self.instance_id = str(r.json().get("id") or body["id"])
                            self.registered.set()
                            log.info("dlmix: registered with router %s as %s", self.base, self.instance_id)
                        else:
                            self.last_error = f"register: HTTP {r.status_code} {r.text[:300]}"
                            log.warning("dlmix: router registration refused: %s", self.last_error)
                            self._stop.wait(max(5.0, 5 * self.heartbeat_s))
                            continue
                    ld = self.load()
                    hb = {"waiting": int(ld.get("waiting", 0)), "running": int(ld.get("running", 0))}
                    if ld.get("kv_usage") is not None:
                        hb["kv_usage"] = float(ld["kv_usage"])
                    r = http.post(f"{self.base}/admin/instances/{self.instance_id}/heartbeat", json=hb)
                    if r.status_code == 404:
                        self.instance_id = None
                        lost_in_a_row += 1
                        self.last_error = "heartbeat: HTTP 404 (instance unknown to the router): registering again"
                        if lost_in_a_row == 1:
                            continue  # the router restarted or expired us: register again at once
                        # again at once after a fresh registration (e.g. replicas that do not share their
                        # instances): retry at the heartbeat period, not in a tight loop
                    elif r.status_code == 200:
                        self.heartbeats += 1
                        lost_in_a_row = 0
                except Exception as e:  # router down, or a body that cannot be built yet: retry, never raise
                    self.last_error = f"{type(e).__name__}: {e}"
                    log.debug("dlmix: router unreachable: %s", self.last_error)
                self._stop.wait(self.heartbeat_s)
