"""Answers the router collects or relays for a client, from hostile or broken engines: size bounds, backpressure on
fanned-out streams, whole-answer deadlines on engine handshakes, and holds freed when a hand-off fails or the client
goes away (all with in-process stand-in engines)."""
from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time

import httpx
import pytest

from dlmix.router.config import RouterConfig
from dlmix.router.engines import lmdeploy as lmd
from dlmix.router.server import Router
from dlmix.testing import JsonStandIn, LoopThread, RouterThread, poll, raw_server, read_http_request
from dlmix.testing.mock_engine import MockEngine


# ---- a router over raw SGLang stand-ins whose decode answers as a test says
PD = {"policy": "cost", "policy_params": {"local_max_uncached": 0}, "model_spec": "llama-3.1-8b"}


class FanOut:
    """A router (cost policy) over a raw SGLang prefill that answers ``{}`` at once and a raw SGLang decode whose
    answer ``decode_answer(writer, state)`` writes; ``state`` counts bytes ``sent``, connections ``cut`` and
    ``decode_reqs``."""

    def __init__(self, decode_answer, **cfg):
        self.lt, self.blt = LoopThread(), LoopThread()
        self.state = {"sent": 0, "cut": 0, "decode_reqs": 0}
        st = self.state

        async def prefill(reader, writer):
            try:
                while True:
                    await read_http_request(reader)
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}")
                    await writer.drain()
            except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
                pass
            finally:
                writer.close()

        async def decode(reader, writer):
            try:
                await read_http_request(reader)
                st["decode_reqs"] += 1
                await decode_answer(writer, st)
                await asyncio.sleep(3600)
            except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
                st["cut"] += 1
            finally:
                writer.close()

        self.ps, pp = self.blt.run(raw_server(prefill))
        self.ds, dp = self.blt.run(raw_server(decode))
        insts = [{"url": f"http://127.0.0.1:{pp}", "model": "mock", "role": "prefill", "id": "p", "chip": "H100",
                  "engine": "sglang", "bootstrap_port": 7021},
                 {"url": f"http://127.0.0.1:{dp}", "model": "mock", "role": "decode", "id": "d", "chip": "H20",
                  "engine": "sglang"}]
        cfg.setdefault("health_interval_s", 3600.0)
        self.router = Router(RouterConfig(port=0, instances=insts, **PD, **cfg))
        self.lt.run(self.router.start())
        self.base = f"http://127.0.0.1:{self.router.cfg.port}"

    def close(self):
        self.lt.run(self.router.stop())
        self.blt.call(self.ps.close)
        self.blt.call(self.ds.close)
        self.lt.close()
        self.blt.close()


# ---- an LMDeploy pair whose DistServe handshake answers JSON of the wrong shape
class LMDeployStandIn(JsonStandIn):
    """An LMDeploy api_server stand-in whose DistServe handshake routes answer ``handshake`` (default: the right
    shape) after ``delay_s`` seconds; ``free_cache`` calls are recorded in ``freed``."""

    def __init__(self, role, handshake=None, delay_s=0.0):
        self.freed = []
        answer = {"engine_endpoint_info": {}, "kvtransfer_endpoint_info": []} if handshake is None else handshake

        def route(method, path, body):
            if method == "GET" and path != "/distserve/engine_info":
                return 200, {"data": [{"id": "m"}]} if path == "/v1/models" else {}
            if path == "/distserve/free_cache":
                self.freed.append(body)
                return 200, {"status": "SUCCESS"}
            if path.startswith("/distserve/"):
                time.sleep(delay_s)
                return 200, answer
            if role == "prefill":
                return 200, {"id": "-1", "choices": [{"text": "x"}], "cache_block_ids": [7, 3, 11],
                             "remote_token_ids": [42], "usage": {"prompt_tokens": 40}}
            return 200, {"choices": [{"text": "answer"}]}
        super().__init__(route)

    def close(self):
        super().close()
        lmd.forget(self.url)


def test_malformed_handshake_answer_is_502_and_frees_the_hold():
    """p2p_initialize answers ``{}``: the request gets a 502 naming the pair (not a 500), and the prefill's hold is
    freed at once (``/distserve/free_cache``) instead of waiting for its hold timeout."""
    p, d = LMDeployStandIn("prefill", handshake={}), LMDeployStandIn("decode", handshake={})
    rt = RouterThread(RouterConfig(host="127.0.0.1", port=0, policy="round_robin", retries=0))
    try:
        with httpx.Client(base_url=rt.url, timeout=30) as c:
            for url, role in ((p.url, 2), (d.url, 3)):
                assert c.post("/nodes/add", json={"url": url, "status": {"models": ["m"], "role": role}}).status_code == 200
            r = c.post("/v1/completions", json={"model": "m", "prompt": "hello", "max_tokens": 4})
            assert r.status_code == 502, (r.status_code, r.text)
            assert "internal router error" not in r.text
            assert poll(lambda: p.freed, 5), "prefill hold was not freed"
            # the router keeps serving
            assert c.get("/health").status_code in (200, 503)
    finally:
        rt.close()
        p.close()
        d.close()


# ---- a collected answer (a PD prefill leg) that never ends
PREFILL_CAP = 192 << 20  # what the fake prefill sends at most before it falls silent
BODY = {"model": "mock", "prompt": "The quick brown fox jumps over the lazy dog. " * 20, "max_tokens": 7,
        "temperature": 0.0}


def test_a_huge_collected_prefill_answer_is_cut_off():
    """A PD prefill leg answering 200 with an endless body is cut off past ``proxy.MAX_COLLECTED`` (the router read
    the whole of it before), and the request still gets its answer (prefill on the decode)."""
    lt, blt = LoopThread(), LoopThread()  # router loop, fake-backend loop
    state = {"sent": 0, "cut": False}

    async def conn(reader, writer):
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n")
            chunk = b"%x\r\n%s\r\n" % (1 << 20, b" " * (1 << 20))
            while state["sent"] < PREFILL_CAP:
                writer.write(chunk)
                await writer.drain()
                state["sent"] += 1 << 20
            await asyncio.sleep(3600)
        except (ConnectionError, asyncio.CancelledError):
            state["cut"] = True
        finally:
            writer.close()

    srv, port = blt.run(raw_server(conn))
    d = MockEngine(name="d", role="decode")
    durl = lt.run(d.start())
    insts = [{"url": f"http://127.0.0.1:{port}", "model": "mock", "role": "prefill", "id": "p", "chip": "H100",
              "transport": {"link": "rdma-100g"}},
             {"url": durl, "model": "mock", "role": "decode", "id": "d", "chip": "H20",
              "transport": {"link": "rdma-100g"}}]
    router = Router(RouterConfig(port=0, instances=insts, health_interval_s=3600.0, policy="cost",
                                 policy_params={"local_max_uncached": 0}, model_spec="llama-3.1-8b",
                                 prefill_timeout_s=40.0))
    lt.run(router.start())
    out = {}

    def client():
        with httpx.Client(timeout=60) as h:
            out["r"] = h.post(f"http://127.0.0.1:{router.cfg.port}/v1/completions", json=BODY)
    th = threading.Thread(target=client, daemon=True)
    th.start()
    try:
        # the router must cut the prefill off well before the fake has sent PREFILL_CAP bytes
        poll(lambda: state["cut"] or state["sent"] >= PREFILL_CAP, 30)
        print("fake prefill sent", state["sent"] >> 20, "MiB; cut off:", state["cut"])
        assert state["cut"] and state["sent"] < PREFILL_CAP, f"router read {state['sent'] >> 20} MiB of one prefill answer"
        th.join(20)
        assert "r" in out and out["r"].status_code == 200, out
    finally:
        lt.run(router.stop())
        lt.run(d.stop())
        srv.close()
        lt.close()
        blt.close()


# ---- a fanned-out stream to a client that reads nothing


def test_fanned_out_stream_to_a_client_that_does_not_read_is_bounded():
    """n=2 streamed on an SGLang decode (fanned out), to a client that reads nothing: the choices' backends are paused
    like a single backend's, so the router holds under 1 MiB for the client (it buffered the whole answer before)."""
    lt = LoopThread()
    p = MockEngine(name="p", role="prefill", engine="sglang", bootstrap_port=7011)
    d = MockEngine(name="d", role="decode", engine="sglang")
    for e in (p, d):
        lt.run(e.start())
    insts = [{"url": p.url, "model": "mock", "role": "prefill", "id": "p", "chip": "H100", "engine": "sglang",
              "bootstrap_port": p.bootstrap_port},
             {"url": d.url, "model": "mock", "role": "decode", "id": "d", "chip": "H20", "engine": "sglang"}]
    router = Router(RouterConfig(port=0, instances=insts, health_interval_s=3600.0, **PD))
    lt.run(router.start())
    s = socket.socket()
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", router.cfg.port))
        body = json.dumps({"model": "mock", "prompt": "hi", "max_tokens": 30_000, "stream": True, "n": 2}).encode()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"content-length: %d\r\n\r\n" % len(body) + body)

        def buffered() -> int:
            c = next((c for c in router.hub.conns if c.backends or c.transport.get_write_buffer_size()), None)
            return c.transport.get_write_buffer_size() if c is not None else -1

        poll(lambda: buffered() > 0, 20)
        time.sleep(3.0)
        b = buffered()
        print("router buffered for the client:", b, "B")
        assert 0 < b < 1 << 20, f"router buffered {b} bytes for a client that reads nothing"
    finally:
        s.close()
        lt.run(router.stop())
        for e in (p, d):
            lt.run(e.stop())
        lt.close()


# ---- a fanned-out non-streamed choice that never ends

CHOICE_CAP = 96 << 20


async def endless(writer, st):
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n")
    chunk = b"%x\r\n%s\r\n" % (1 << 20, b" " * (1 << 20))
    sent = 0
    while sent < CHOICE_CAP:
        writer.write(chunk)
        await writer.drain()
        sent += 1 << 20
        st["sent"] += 1 << 20


def test_a_huge_non_streamed_choice_is_cut_off_with_502():
    """n=2 non-streamed on an SGLang decode whose answers never end: each choice is cut off past
    ``proxy.MAX_COLLECTED`` and the client gets a 502 (the router collected without bound before)."""
    f = FanOut(endless, retries=0)
    out = {}

    def client():
        with httpx.Client(timeout=60) as h:
            out["r"] = h.post(f.base + "/v1/completions", json={"model": "mock", "prompt": "hi", "max_tokens": 5,
                                                                 "n": 2})
    th = threading.Thread(target=client, daemon=True)
    th.start()
    try:
        poll(lambda: f.state["cut"] == 2 or f.state["sent"] >= 2 * CHOICE_CAP, 40)
        print("fake decodes sent", f.state["sent"] >> 20, "MiB; cut:", f.state["cut"])
        assert f.state["cut"] == 2 and f.state["sent"] < 2 * CHOICE_CAP, \
            f"router read {f.state['sent'] >> 20} MiB of two choices' answers"
        th.join(20)
        assert "r" in out and out["r"].status_code == 502, out
    finally:
        f.close()


# ---- a fanned-out stream whose decode sends one long SSE line in many small chunks
LINE = 32 << 20
PIECE = 256


async def long_line(writer, st):
    """One ``data:`` line of LINE bytes in PIECE-byte chunks (1,024 chunks a write), ended, then ``[DONE]``."""
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
    piece = b"%x\r\n%s\r\n" % (PIECE, b"x" * PIECE)
    writer.write(b"%x\r\ndata: \r\n" % 6)
    batch = piece * 1024
    sent = 0
    while sent < LINE:
        writer.write(batch)
        await writer.drain()
        sent += PIECE * 1024
        st["sent"] += PIECE * 1024
    end = b"\n\ndata: [DONE]\n\n"
    writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(end), end))
    await writer.drain()
    st["done"] = st.get("done", 0) + 1


def test_a_long_sse_line_in_small_chunks_is_read_in_linear_time():
    """Both choices' decodes send a 32 MiB line in 131,072 chunks of 256 bytes: the router keeps the pending line in
    one growing buffer, so it reads both whole (the senders finish) within a minute even on a loaded machine. Copying
    the pending line on every chunk, as it did, moves about 2 TB here (hours): the senders, held by TCP flow control,
    would not finish."""
    f = FanOut(long_line, retries=0)
    s = socket.create_connection(("127.0.0.1", f.router.cfg.port))
    try:
        body = json.dumps({"model": "mock", "prompt": "hi", "max_tokens": 5, "n": 2, "stream": True}).encode()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"content-length: %d\r\n\r\n" % len(body) + body)

        def drain():  # the client reads its answer (else backpressure rightly holds the decodes back)
            with contextlib.suppress(OSError):
                while s.recv(1 << 20):
                    pass
        threading.Thread(target=drain, daemon=True).start()
        assert poll(lambda: f.state.get("done") == 2, 60), \
            f"the router read {f.state['sent'] >> 20} of {2 * LINE >> 20} MiB of the two long lines in 60 s"
        with httpx.Client(timeout=10) as h:  # and it keeps serving
            assert h.get(f.base + "/health").status_code == 200
    finally:
        s.close()
        f.close()


# ---- a client that goes away during the pair handshake
def test_client_gone_during_pair_handshake_frees_the_prefill_hold():
    """The client gives up while the router runs the LMDeploy pair handshake: the prefill's hold is freed then, not
    left to its hold timeout."""
    p, d = LMDeployStandIn("prefill", delay_s=1.5), LMDeployStandIn("decode", delay_s=1.5)
    rt = RouterThread(RouterConfig(host="127.0.0.1", port=0, policy="round_robin", retries=0))
    try:
        with httpx.Client(base_url=rt.url, timeout=30) as c:
            for url, role in ((p.url, 2), (d.url, 3)):
                assert c.post("/nodes/add", json={"url": url, "status": {"models": ["m"], "role": role}}).status_code == 200
        with pytest.raises(httpx.ReadTimeout):  # the client gives up while the pair handshake runs
            with httpx.Client(base_url=rt.url, timeout=httpx.Timeout(10, read=0.7)) as c:
                c.post("/v1/completions", json={"model": "m", "prompt": "hello", "max_tokens": 4})
        assert any(path == "/v1/completions" for path, _ in p.calls)  # the prefill leg ran: it holds the KV
        assert poll(lambda: p.freed, 8), "the prefill's hold was not freed after the client went away"
    finally:
        rt.close()
        p.close()
        d.close()


# ---- a handshake answer sent one byte at a time
def test_a_dribbling_handshake_answer_does_not_hold_the_request_for_ever(monkeypatch):
    """An engine sends its handshake answer a byte every 0.4 s (each read within the 1 s timeout): the whole answer
    has a deadline, so the client gets a 502 instead of waiting for ever."""
    monkeypatch.setattr(lmd, "CONNECT_TIMEOUT_S", 1.0)
    blt = LoopThread()

    async def conn(reader, writer):
        try:
            head = await read_http_request(reader)
            if b"/distserve/" not in head.split(b"\r\n")[0]:
                body = (b'{"data":[{"id":"m"}]}' if b"/v1/models" in head else
                        b'{"id":"-1","cache_block_ids":[7],"remote_token_ids":[42],"choices":[{"text":"x"}]}')
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                             b"connection: close\r\n\r\n%s" % (len(body), body))
                await writer.drain()
                return
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 100000\r\n\r\n")
            while True:
                writer.write(b" ")
                await writer.drain()
                await asyncio.sleep(0.4)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    srv, port = blt.run(raw_server(conn))
    d = JsonStandIn(lambda m, p, b: (200, {"choices": [{"text": "answer"}]}))
    rt = RouterThread(RouterConfig(host="127.0.0.1", port=0, policy="round_robin", retries=0,
                                   health_interval_s=3600.0))
    try:
        with httpx.Client(base_url=rt.url, timeout=30) as c:
            for url, role in ((f"http://127.0.0.1:{port}", 2), (d.url, 3)):
                assert c.post("/nodes/add", json={"url": url, "status": {"models": ["m"], "role": role}}).status_code == 200
        t = time.perf_counter()
        try:
            with httpx.Client(base_url=rt.url, timeout=8) as c:
                r = c.post("/v1/completions", json={"model": "m", "prompt": "hello", "max_tokens": 4})
            got = r.status_code
        except httpx.ReadTimeout:
            got = None
        print("answer:", got, "after", round(time.perf_counter() - t, 1), "s")
        assert got == 502, "no answer: the handshake holds the request for ever"
    finally:
        rt.close()
        d.close()
        blt.call(srv.close)
        blt.close()
        lmd.forget(f"http://127.0.0.1:{port}")

