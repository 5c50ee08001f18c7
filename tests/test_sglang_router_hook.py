"""The SGLang scheduler hook (``dlmix_sglang.router_hook``) against the real dlmix router: registration from
SGLang's server arguments, heartbeats with the scheduler's load and KV usage. A stand-in scheduler object carries the
attributes the hook reads (no SGLang needed); the real-server check is in tests/test_sglang_pd.py."""
from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import pytest

from dlmix.pd.contract import ContractError
from dlmix.router.config import RouterConfig
from dlmix.testing import RouterThread, wait_until
from dlmix_sglang import router_hook as H
from dlmix_sglang.config import load_settings


class _Queue:
    def __init__(self, n):
        self.queue = [object()] * n


class _Pool:
    def __init__(self, usage):
        self.usage = usage

    def get_pool_stats(self):
        return SimpleNamespace(get_kv_token_stats=lambda: (123, self.usage))


def _scheduler(mode: str, port: int, waiting=0, running=0, usage=0.0, **sa):
    args = dict(host="127.0.0.1", port=port, served_model_name="smollm2", model_path="/models/smollm2",
                page_size=16, tp_size=1, disaggregation_bootstrap_port=port + 1000, kv_events_config=None)
    args.update(sa)
    s = SimpleNamespace(server_args=SimpleNamespace(**args), disaggregation_mode=SimpleNamespace(value=mode),
                        waiting_queue=[object()] * waiting, running_batch=SimpleNamespace(reqs=[object()] * running),
                        pool_stats_observer=_Pool(usage))
    if mode == "prefill":
        s.disagg_prefill_bootstrap_queue = _Queue(2)
    elif mode == "decode":
        s.disagg_decode_prealloc_queue, s.disagg_decode_transfer_queue = _Queue(1), _Queue(3)
    return s


def test_body_from_server_args():
    st = load_settings({"router_url": "http://127.0.0.1:9", "chip_profile": "cpu-x86"})
    sa = dict(kv_events_config=json.dumps({"publisher": "zmq", "endpoint": "tcp://*:5557", "bind": True}),
              host="0.0.0.0", tp_size=2)
    b = H.scheduler_body(_scheduler("prefill", 30000, **sa), st)
    assert b == {"url": "http://127.0.0.1:30000", "role": "prefill", "engine": "sglang", "model": "smollm2",
                 "chip": "cpu-x86", "num_chips": 2, "block_size": 16, "kv_events": "tcp://127.0.0.1:5557",
                 "heartbeat_ttl_s": 6.0, "bootstrap_port": 31000}
    d = H.scheduler_body(_scheduler("decode", 30001), load_settings({"router_url": "http://127.0.0.1:9",
                                                                     "public_url": "http://10.0.0.5:8001",
                                                                     "heartbeat_s": 5, "num_chips": 4}))
    assert (d["url"], d["role"], d["num_chips"], d["heartbeat_ttl_s"]) == ("http://10.0.0.5:8001", "decode", 4, 15.0)
    assert "bootstrap_port" not in d and "kv_events" not in d  # a decode instance has no bootstrap server to name
    assert H.scheduler_body(_scheduler("null", 30002), st)["role"] == "both"
    with pytest.raises(ContractError):
        H.scheduler_body(_scheduler("decode", 0), st)


def test_load_from_the_scheduler_queues():
    assert H.scheduler_load(_scheduler("prefill", 1, waiting=3, running=2, usage=0.25)) == \
        {"waiting": 5, "running": 2, "kv_usage": 0.25}  # waiting queue + prefill bootstrap queue
    assert H.scheduler_load(_scheduler("decode", 1, waiting=1, running=7, usage=0.5)) == \
        {"waiting": 5, "running": 7, "kv_usage": 0.5}  # + decode pre-allocation and transfer queues

    broken = _scheduler("null", 1, waiting=1)
    broken.pool_stats_observer = SimpleNamespace(get_pool_stats=lambda: 1 / 0)
    assert H.scheduler_load(broken) == {"waiting": 1, "running": 0, "kv_usage": None}


def test_hook_registers_and_heartbeats_with_the_router(monkeypatch):
    r = RouterThread(RouterConfig(port=0))
    clients = []
    try:
        monkeypatch.setenv("DLMIX_SGLANG_CONFIG", json.dumps({"router_url": r.url, "heartbeat_s": 0.2}))
        p = _scheduler("prefill", 18500, waiting=1, running=1, usage=0.125)
        d = _scheduler("decode", 18501, waiting=0, running=4, usage=0.75)
        for s in (p, d):
            assert H.after_scheduler_init(None, s) is None
            clients.append(s.dlmix_router_client)

        def listed():  # registered, and each one's first heartbeat arrived (registration alone lists load 0)
            got = {i["url"]: i for i in httpx.get(r.url + "/admin/instances", timeout=5).json()["instances"]}
            loads = {u: (i["load"]["waiting"], i["load"]["running"], i["load"]["kv_usage"]) for u, i in got.items()}
            return got if loads == {"http://127.0.0.1:18500": (3, 1, 0.125),
                                    "http://127.0.0.1:18501": (4, 4, 0.75)} else None

        got = wait_until(listed, 60, "both SGLang schedulers registered and heartbeating")
        pi, di = got["http://127.0.0.1:18500"], got["http://127.0.0.1:18501"]
        assert (pi["engine"], pi["role"], pi["block_size"]) == ("sglang", "prefill", 16)
        assert (di["engine"], di["role"]) == ("sglang", "decode")
        # the prefill's bootstrap port: where the router sends both legs of SGLang's PD flow
        assert r.call(lambda: {i.id: i.extra.get("bootstrap_port") for i in r.router.instances}) == \
            {pi["id"]: 19500, di["id"]: None}
        assert (pi["load"]["waiting"], pi["load"]["running"], pi["load"]["kv_usage"]) == (3, 1, 0.125)
        assert (di["load"]["waiting"], di["load"]["running"], di["load"]["kv_usage"]) == (4, 4, 0.75)
        # the load moves: the next heartbeats carry it
        d.running_batch.reqs = []
        d.pool_stats_observer = _Pool(0.0)
        wait_until(lambda: httpx.get(f"{r.url}/admin/instances/{di['id']}", timeout=5).json()["load"]["running"] == 0,
                   60, "a heartbeat with the decode's new load")
        # the prefill's second heartbeat may still be on its way on a loaded machine
        wait_until(lambda: all(c.heartbeats >= 2 for c in clients), 60, "two heartbeats from each scheduler")
        assert [c.last_error for c in clients] == [None, None]
    finally:
        for c in clients:
            c.stop()
        r.close()


def test_no_router_url_no_client(monkeypatch):
    monkeypatch.setenv("DLMIX_SGLANG_CONFIG", json.dumps({"transport": "tcp"}))
    s = _scheduler("decode", 1)
    H.after_scheduler_init(None, s)
    assert not hasattr(s, "dlmix_router_client")
