"""The router's client-facing HTTP layer under hostile clients and broken backends (issue 18, item 1).

Each test starts the router in process on a free port over mock engines (dlmix.testing.mock_engine) or a raw asyncio
backend that misbehaves on purpose, and talks to it over raw sockets where a well-behaved client library would not
misbehave. Assertions are on statuses, bytes and the order of events; the only times are small configured timeouts
and generous liveness bounds (socket timeouts), never a speed expectation.
"""
from __future__ import annotations

import asyncio
import json
import select
import socket
import threading
import time

import httpx
import pytest

from dlmix.router.config import ConfigError, RouterConfig
from dlmix.router.server import Router
from dlmix.testing import LoopThread, free_port, poll, raw_server, read_http_request
from dlmix.testing.mock_engine import MockEngine

LIVE = 20.0  # liveness bound (s): a socket that stays silent this long means the router never acted


@pytest.fixture(scope="module")
def lt():
    t = LoopThread()
    yield t
    t.close()


class Setup:
    """A router over ``engines`` (MockEngine objects or plain URLs) with config ``cfg``."""

    def __init__(self, lt, engines, **cfg):
        self.lt = lt
        self.engines = [e for e in engines if isinstance(e, MockEngine)]
        urls = [lt.run(e.start()) if isinstance(e, MockEngine) else e for e in engines]
        insts = [{"url": u, "model": "mock", "id": f"i{k}", "chip": "cpu-x86"} for k, u in enumerate(urls)]
        cfg.setdefault("health_interval_s", 3600.0)  # the tests below decide what the backends do
        cfg.setdefault("policy", "round_robin")
        self.router = Router(RouterConfig(port=0, instances=insts, **cfg))
        lt.run(self.router.start())
        self.port = self.router.cfg.port
        self.base = f"http://127.0.0.1:{self.port}"

    def sock(self) -> socket.socket:
        s = socket.create_connection(("127.0.0.1", self.port), timeout=LIVE)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return s

    def close(self):
        self.lt.run(self.router.stop())
        for e in self.engines:
            self.lt.run(e.stop())


def _read_response(s) -> tuple:
    """(status, headers dict, body) of one Content-Length framed response, read from a raw socket or from a
    buffered reader (``sock.makefile("rb")``: needed when several responses follow each other)."""
    f = s.makefile("rb") if isinstance(s, socket.socket) else s
    line = f.readline()
    if not line:
        raise ConnectionError("closed before a response")
    hdrs = {}
    while True:
        h = f.readline()
        if h in (b"\r\n", b""):
            break
        k, _, v = h.decode("latin-1").partition(":")
        hdrs[k.strip().lower()] = v.strip()
    body = f.read(int(hdrs.get("content-length", "0")))
    return int(line.split()[1]), hdrs, body


def _closed_or_answered(s: socket.socket) -> bytes | None:
    """Non-blocking look at the socket: None while the router says nothing, else what it sent (b"" = closed)."""
    r, _, _ = select.select([s], [], [], 0)
    if not r:
        return None
    try:
        return s.recv(65536)
    except ConnectionError:
        return b""


def _dribble(s: socket.socket, data: bytes, gap: float) -> tuple:
    """Send ``data`` one byte every ``gap`` seconds until the router answers or closes. Returns (bytes sent, what
    the router sent or None if it never did)."""
    import time

    for k in range(len(data)):
        got = _closed_or_answered(s)
        if got is not None:
            return k, got
        try:
            s.sendall(data[k:k + 1])
        except OSError:
            return k, b""
        time.sleep(gap)
    r, _, _ = select.select([s], [], [], 1.0)
    return len(data), (s.recv(65536) if r else None)


HEAD = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
BODY = {"model": "mock", "prompt": "The quick brown fox jumps over the lazy dog. " * 4, "max_tokens": 5}


# ---------------------------------------------------------------------------------------------- slow bodies
def test_one_byte_chunked_body_does_not_freeze_other_clients(lt):
    """A body in 1-byte chunks (chunked encoding) costs O(1) per chunk: a healthy client's request completes while
    the dribbler's body is still incomplete, and the dribbler's request then completes with its exact bytes."""
    e = MockEngine(name="a")
    st = Setup(lt, [e])
    try:
        body = json.dumps(dict(BODY, prompt="y" * 150_000)).encode()
        d = st.sock()
        d.sendall(HEAD + b"transfer-encoding: chunked\r\n\r\n")
        sent = threading.Event()

        def dribbler():  # everything but the last byte and the terminating chunk
            d.sendall(b"".join(b"1\r\n%s\r\n" % body[k:k + 1] for k in range(len(body) - 1)))
            sent.set()
        t = threading.Thread(target=dribbler, daemon=True)
        t.start()
        assert sent.wait(LIVE), "router stopped reading the dribbled body"
        with httpx.Client(timeout=LIVE) as h:
            r = h.post(st.base + "/v1/completions", content=json.dumps(BODY).encode())  # the healthy client
        assert r.status_code == 200 and len(r.json()["choices"][0]["text"].split()) == 5
        assert len(e.received) == 1 and e.received[0] == json.dumps(BODY).encode()  # dribbler not complete yet
        d.sendall(b"1\r\n%s\r\n0\r\n\r\n" % body[-1:])
        status, _, _ = _read_response(d)
        assert status == 200 and e.received[-1] == body
        d.close()
    finally:
        st.close()


# ---------------------------------------------------------------------------------------------- timeouts
def test_header_body_and_idle_timeouts_close_slow_clients(lt):
    st = Setup(lt, [MockEngine(name="a")], header_timeout_s=1.0, body_timeout_s=1.0, keepalive_timeout_s=1.0)
    try:
        # slowloris head: one header byte every 50 ms would take 20 s; the router answers 408 and closes first
        s = st.sock()
        s.sendall(HEAD)
        n, got = _dribble(s, b"x-slow: " + b"a" * 392 + b"\r\n", 0.05)
        assert got is not None and n < 400, "the router kept a dribbling request head open"
        assert got == b"" or got.startswith(b"HTTP/1.1 408")
        s.close()
        # slow body: Content-Length 400, one byte every 50 ms
        s = st.sock()
        s.sendall(HEAD + b"content-length: 400\r\n\r\n")
        n, got = _dribble(s, b"z" * 400, 0.05)
        assert got is not None and n < 400, "the router kept a dribbling body open"
        assert got == b"" or got.startswith(b"HTTP/1.1 408")
        s.close()
        # a connection that never sends a byte is closed (header timeout from the accept)
        s = st.sock()
        got = s.recv(100)
        assert got == b"" or got.startswith(b"HTTP/1.1 408")
        s.close()
        # an idle kept-alive connection is closed after its request
        s = st.sock()
        raw = json.dumps(BODY).encode()
        s.sendall(HEAD + b"content-length: %d\r\n\r\n%s" % (len(raw), raw))
        assert _read_response(s)[0] == 200
        assert s.recv(100) == b""  # closed by the router (the socket timeout is the liveness bound)
        s.close()
        assert st.router.hub.timeouts >= 3
    finally:
        st.close()


def test_connection_cap_refuses_with_503_then_recovers(lt):
    st = Setup(lt, [MockEngine(name="a")], max_connections=4)
    held = [st.sock() for _ in range(4)]
    try:
        for _ in range(400):  # wait until the router accepted all four (they count) ...
            if lt.call(lambda: len(st.router.hub.conns)) == 4:
                break
            lt.run(asyncio.sleep(0.01))
        s = st.sock()  # ... the fifth gets a readable 503 and a close
        status, hdrs, body = _read_response(s)
        assert status == 503 and hdrs.get("connection") == "close" and b"max_connections" in body
        s.close()
        assert st.router.hub.refused == 1
        held.pop().close()
        for _ in range(200):  # once the router saw the close, a new client is served
            with httpx.Client(timeout=LIVE) as h:
                try:
                    r = h.post(st.base + "/v1/completions", json=BODY)
                except httpx.TransportError:
                    continue
            if r.status_code == 200:
                break
            assert r.status_code == 503
        assert r.status_code == 200
    finally:
        for s in held:
            s.close()
        st.close()


def test_pipelined_flood_is_answered_in_order(lt):
    """200 pipelined requests in one write: the router stops reading while 32 wait, and answers all, in order."""
    e = MockEngine(name="a")
    st = Setup(lt, [e])
    try:
        s = st.sock()
        reqs = [json.dumps(dict(BODY, prompt=f"request {k}")).encode() for k in range(200)]
        s.sendall(b"".join(HEAD + b"content-length: %d\r\n\r\n%s" % (len(r), r) for r in reqs))
        f = s.makefile("rb")
        for k in range(200):
            status, _, body = _read_response(f)
            assert status == 200 and e.received[k] == reqs[k]
        s.close()
    finally:
        st.close()


# ---------------------------------------------------------------------------------------------- size limits
def test_url_header_and_body_limits(lt):
    st = Setup(lt, [MockEngine(name="a")], max_body_mb=1)
    try:
        with httpx.Client(timeout=LIVE) as h:
            r = h.post(st.base + "/v1/completions?" + "a" * 9000, json=BODY)
            assert r.status_code == 414 and "max_url" in r.text
            r = h.post(st.base + "/v1/completions", json=BODY, headers={"x-big": "b" * 40_000})
            assert r.status_code == 431 and "max_header_bytes" in r.text
            r = h.post(st.base + "/v1/completions", json=BODY, headers={f"x-h{k}": "1" for k in range(150)})
            assert r.status_code == 431 and "max_headers" in r.text
            # over the limit with Content-Length: a readable 413 (not a connection reset), sent after the body
            r = h.post(st.base + "/v1/completions", json=dict(BODY, prompt="x" * (2 << 20)))
            assert r.status_code == 413 and "max_body_mb" in r.text
            # and with chunked encoding (no length known in advance)
            r = h.post(st.base + "/v1/completions", content=iter([b"x" * 16384] * 128))
            assert r.status_code == 413 and "max_body_mb" in r.text
            # the router still serves
            assert h.post(st.base + "/v1/completions", json=BODY).status_code == 200
        # a head that never ends (one header line growing forever) is cut at the limit too
        s = st.sock()
        s.sendall(HEAD + b"x-endless: ")
        got = b""
        try:
            for _ in range(64):
                s.sendall(b"c" * 4096)
        except OSError:
            pass
        got = s.recv(65536)
        assert got.startswith(b"HTTP/1.1 431")
        s.close()
    finally:
        st.close()


# ---------------------------------------------------------------------------------------------- broken backends
OK = b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}'


async def _fake_backend(*answers: bytes) -> tuple:
    """A backend that answers the k-th request on a connection with ``answers[k]`` and then never answers again.
    Returns (url, asyncio server)."""

    async def conn(reader, writer):
        try:
            for a in answers:
                await read_http_request(reader)
                writer.write(a)
                await writer.drain()
            await asyncio.sleep(3600)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()
    srv, port = await raw_server(conn)
    return f"http://127.0.0.1:{port}", srv


@pytest.mark.parametrize("garbage", [b"garbage that is not HTTP\r\n\r\n",
                                     b"HTTP/1.1 200 OK\r\ncontent-length: 12\r\nbroken header line\r\n\r\n",
                                     b"HTTP/1.1 200 OK\r\ncontent-length: nope\r\n\r\n"])
@pytest.mark.parametrize("stream", [False, True])
def test_backend_garbage_is_502_not_forwarded(lt, garbage, stream):
    url, srv = lt.run(_fake_backend(garbage))
    st = Setup(lt, [url])
    try:
        with httpx.Client(timeout=LIVE) as h:
            r = h.post(st.base + "/v1/completions", json=dict(BODY, stream=stream))
        assert r.status_code == 502 and "bad HTTP from backend" in r.json()["error"]["message"]
        assert b"garbage" not in r.content and b"broken" not in r.content
    finally:
        st.close()
        srv.close()


@pytest.mark.parametrize("status_line", [b"HTTP/1.1 200 OK", b"HTTP/1.1 200 ", b"HTTP/1.1 200"])
def test_a_collected_answer_has_its_status_with_or_without_a_reason_phrase(lt, status_line):
    """The status of an answer the router collects (a prefill leg's) comes from the status line whether or not it has
    a reason phrase (httptools reports none for "HTTP/1.1 200": such a 200 counted as status 0, and a PD request
    then failed with "prefill instance ... answered 0")."""
    from dlmix.router.proxy import Pool, build_request, request

    answer = status_line + b"\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"
    url, srv = lt.run(_fake_backend(answer))
    host, port = url.rsplit("/", 1)[1].split(":")

    async def go():
        pool = Pool(host, int(port), "fake")
        c = await request(pool, build_request(b"POST", b"/v1/completions", b"fake", b"", b"{}"), timeout=10)
        return c.collected()

    try:
        status, _headers, body = lt.run(go())
        assert (status, body) == (200, b"{}")
    finally:
        srv.close()


def test_a_leg_run_as_a_task_keeps_its_answer_when_its_connection_is_reused(lt):
    """A PD leg runs as its own task and is read after other tasks ran: its connection is back in the pool by then,
    and the next request on it must not change what the leg got (it did: the next request reset the status to 0,
    which failed a PD request with "prefill instance ... answered 0")."""
    from dlmix.router.proxy import Pool, build_request, request

    url, srv = lt.run(_fake_backend(OK, b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 3\r\n\r\nbad"))
    host, port = url.rsplit("/", 1)[1].split(":")

    async def go():
        pool = Pool(host, int(port), "fake")
        raw = build_request(b"POST", b"/v1/completions", b"fake", b"", b"{}")
        leg = asyncio.ensure_future(request(pool, raw, timeout=10))
        await asyncio.wait((leg,))
        second = await request(pool, raw, timeout=10)  # the same kept-alive connection
        return leg.result().collected(), second.collected()

    try:
        first, second = lt.run(go())
        assert (first[0], first[2], second[0], second[2]) == (200, b"{}", 503, b"bad")
    finally:
        srv.close()


@pytest.mark.parametrize("fast_path", [True, False])
def test_backend_that_hangs_gets_504(lt, fast_path):
    url, srv = lt.run(_fake_backend(OK))  # answers the first request on a connection, then hangs
    st = Setup(lt, [url], backend_read_timeout_s=0.3, fast_path=fast_path, retries=0)
    try:
        with httpx.Client(timeout=LIVE) as h:
            assert h.post(st.base + "/v1/completions", json=BODY).status_code == 200
            # the second request reuses the pooled connection (on the callback path when fast_path is on)
            r = h.post(st.base + "/v1/completions", json=BODY)
            assert r.status_code == 504 and "sent nothing" in r.json()["error"]["message"]
            r = h.post(st.base + "/v1/completions", json=BODY)  # a new connection: answered, the router serves on
            assert r.status_code == 200
    finally:
        st.close()
        srv.close()


def test_backend_connect_failure_is_502(lt):
    st = Setup(lt, [f"http://127.0.0.1:{free_port()}"])  # nothing listens there
    try:
        with httpx.Client(timeout=LIVE) as h:
            r = h.post(st.base + "/v1/completions", json=BODY)
        assert r.status_code == 502 and "cannot connect" in r.json()["error"]["message"]
    finally:
        st.close()


# ---------------------------------------------------------------------------------------------- malformed bodies
DEEP = b'{"model": "mock", "prompt": "hi", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"


@pytest.mark.parametrize("path,body,needle", [
    ("/v1/chat/completions", {"model": "mock", "messages": [{"role": "user", "content": [{"type": "text",
                                                                                          "text": 5}]}]},
     "$.messages[0].content[0].text"),
    ("/v1/chat/completions", {"model": "mock", "messages": "hi"}, "$.messages"),
    ("/v1/completions", {"model": "mock", "prompt": "hi", "max_tokens": "7"}, "$.max_tokens"),
    ("/v1/completions", {"model": "mock", "prompt": "hi", "stream": "yes"}, "$.stream"),
    ("/v1/completions", {"model": 7, "prompt": "hi"}, "$.model"),
    ("/v1/completions", {"model": "mock", "prompt": {"text": "hi"}}, "$.prompt"),
    ("/v1/completions", {"model": "mock"}, "prompt"),
    # an empty prompt: every engine refuses it, and LMDeploy 0.18's engine loop died on it (the instance then
    # served nothing until restarted)
    ("/v1/completions", {"model": "mock", "prompt": ""}, "prompt must not be empty"),
    ("/v1/completions", {"model": "mock", "prompt": []}, "prompt must not be empty"),
    ("/v1/completions", {"model": "mock", "prompt": ["a", ""]}, "prompt must not be empty"),
    ("/v1/completions", {"model": "mock", "prompt": [[1, 2], []]}, "prompt must not be empty"),
    ("/v1/completions", DEEP, "nested too deeply"),
    ("/v1/completions", b'{"model": "mock", "prompt": "\xff\xfe"}', "UTF-8"),
    ("/v1/completions", b"[1, 2]", "JSON object"),
])
def test_malformed_bodies_get_400_naming_the_problem(lt, path, body, needle):
    e = MockEngine(name="a")
    st = Setup(lt, [e], policy="cost")  # a policy that reads the prompt parses every body
    try:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        with httpx.Client(timeout=LIVE) as h:
            r = h.post(st.base + path, content=raw, headers={"content-type": "application/json"})
            assert r.status_code == 400, r.text
            assert needle in r.json()["error"]["message"]
            assert not e.received  # refused before any engine saw it
            assert h.post(st.base + "/v1/completions", json=BODY).status_code == 200
    finally:
        st.close()


@pytest.mark.parametrize("fast_path", [True, False])
@pytest.mark.parametrize("policy", ["cost", "round_robin"])  # cost parses every body; round_robin none (fast path)
@pytest.mark.parametrize("extra,field", [
    (b'"kv_transfer_params": {"do_remote_prefill": true, "remote_host": "10.9.9.9", "remote_port": 1}',
     "kv_transfer_params"),
    (b'"kv_transfer_param\\u0073": {"do_remote_prefill": true}', "kv_transfer_params"),  # the key, JSON-escaped
    (b'"bootstrap_host": "10.9.9.9", "bootstrap_port": 8998, "bootstrap_room": 7', "bootstrap_host"),
    (b'"bootstrap_room": 0', "bootstrap_room"),
    (b'"preserve_cache": true', "preserve_cache"),
    (b'"migration_request": {"remote_engine_id": "http://10.9.9.9:1", "remote_block_ids": [1]}',
     "migration_request"),
], ids=["vllm", "vllm-escaped-key", "sglang", "sglang-room-0", "lmdeploy-preserve", "lmdeploy-migration"])
def test_a_client_body_with_a_pd_handoff_field_is_400(lt, fast_path, policy, extra, field):
    """The fields that carry a PD hand-off (every engine adapter's ``HANDOFF_FIELDS``) are the router's to set. A
    client body that sets one is refused before any engine sees it: it would make an instance pull KV from a host of
    the client's choosing, or keep a request's KV blocks after its answer (LMDeploy's ``preserve_cache``). ``null``,
    ``false`` and the names inside a prompt's text pass."""
    e = MockEngine(name="a", record=True)
    st = Setup(lt, [e], policy=policy, fast_path=fast_path)
    try:
        with httpx.Client(timeout=LIVE) as h:
            for _ in range(2):  # the second one rides the pooled connection (the fast path's callback driver)
                assert h.post(st.base + "/v1/completions", json=BODY).status_code == 200
            n = len(e.received)
            raw = b'{"model": "mock", "prompt": "hi", "max_tokens": 2, ' + extra + b"}"
            r = h.post(st.base + "/v1/completions", content=raw, headers={"content-type": "application/json"})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["message"] == (f"invalid request body: `{field}` is set by the router for "
                                                    f"prefill/decode hand-offs; a client may not send it")
            assert len(e.received) == n  # refused before any engine saw it
            fine = (b'{"model": "mock", "prompt": "what is \\"kv_transfer_params\\"? \\u00e9", "max_tokens": 2, '
                    b'"kv_transfer_params": null, "with_cache": false, "bootstrap_room": null}')
            assert h.post(st.base + "/v1/completions", content=fine,
                          headers={"content-type": "application/json"}).status_code == 200
            assert e.received[-1] == fine and len(e.received) == n + 1
    finally:
        st.close()


@pytest.mark.parametrize("policy", ["cost", "round_robin"])  # cost parses every body; round_robin none (fast path)
@pytest.mark.parametrize("body", [b"", b" \r\n"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_an_empty_body_is_400_saying_it_is_empty(lt, policy, body, path):
    e = MockEngine(name="a")
    st = Setup(lt, [e], policy=policy)
    try:
        with httpx.Client(timeout=LIVE) as h:
            r = h.post(st.base + path, content=body, headers={"content-type": "application/json"})
            assert r.status_code == 400, r.text
            assert r.json() == {"error": {"message": "request body is empty; expected a JSON object",
                                          "type": "invalid_request_error", "param": None, "code": 400}}
            assert not e.received  # refused before any engine saw it
            assert h.post(st.base + "/v1/completions", json=BODY).status_code == 200
    finally:
        st.close()


def test_router_errors_on_the_wire_are_openai_error_objects(lt):
    """404, 405 (with an Allow header), 401 and a client-limit refusal (414) over HTTP: one JSON shape."""
    st = Setup(lt, [MockEngine(name="a")], api_keys=["k1"])
    key = {"authorization": "Bearer k1"}
    try:
        with httpx.Client(timeout=LIVE) as h:
            r = h.get(st.base + "/v2/nothing?x=1", headers=key)
            assert r.status_code == 404 and r.headers["content-type"] == "application/json"
            assert r.json() == {"error": {"message": "not found: GET /v2/nothing is not an endpoint of this router",
                                          "type": "invalid_request_error", "param": None, "code": 404}}
            r = h.put(st.base + "/v1/models", headers=key)
            assert r.status_code == 405 and r.headers["allow"] == "GET"
            assert r.json() == {"error": {"message": "method not allowed: PUT /v1/models; use GET",
                                          "type": "invalid_request_error", "param": None, "code": 405}}
            r = h.post(st.base + "/v1/completions", json=BODY)
            assert r.status_code == 401
            assert r.json() == {"error": {"message": "invalid or missing API key (Authorization: Bearer KEY)",
                                          "type": "authentication_error", "param": None, "code": 401}}
            r = h.post(st.base + "/v1/completions?" + "a" * 9000, json=BODY, headers=key)
            assert r.status_code == 414
            assert r.json() == {"error": {"message": "request URL too long (max_url)",
                                          "type": "invalid_request_error", "param": None, "code": 414}}
            assert h.post(st.base + "/v1/completions", json=BODY, headers=key).status_code == 200
    finally:
        st.close()


@pytest.mark.parametrize("policy", ["cost", "round_robin"])
def test_unknown_model_is_404_openai_style(lt, policy):
    st = Setup(lt, [MockEngine(name="a")], policy=policy)
    try:
        with httpx.Client(timeout=LIVE) as h:
            r = h.post(st.base + "/v1/completions", json=dict(BODY, model="no-such-model"))
        assert r.status_code == 404
        err = r.json()["error"]
        assert "no-such-model" in err["message"] and "does not exist" in err["message"]
    finally:
        st.close()


@pytest.mark.parametrize("key", ["header_timeout_s", "max_connections", "max_body_mb", "backend_read_timeout_s"])
def test_non_positive_limit_is_refused_at_construction(key):
    with pytest.raises(ConfigError, match=f"{key} must be a positive number"):
        Router(RouterConfig(port=0, **{key: 0}))


def test_simulator_only_policy_is_refused_at_construction():
    import dlmix.sim  # noqa: F401  (registers the oracle, as the dlmix CLI does before `dlmix router` runs)

    with pytest.raises(ConfigError, match="'oracle' runs only in the simulator"):
        Router(RouterConfig(port=0, policy="oracle"))


# ------------------------------------------------------------------- admin API and token-id prompts out of range
ADMIN_DEEP = b"[" * 100_000 + b"]" * 100_000


@pytest.mark.parametrize("path,body,needle", [
    ("/admin/instances", ADMIN_DEEP, "nested too deeply"),
    ("/admin/instances/i0/heartbeat", ADMIN_DEEP, "nested too deeply"),
    ("/nodes/add", ADMIN_DEEP, "nested too deeply"),
    ("/admin/instances/i0/heartbeat", b'{"waiting": 1' + b"0" * 400 + b"}", "waiting"),
    ("/admin/instances/i0/heartbeat", b'{"waiting": 1, "running": 4294967296}', "running"),
    ("/admin/instances", {"url": "http://127.0.0.1:1", "transport": {"link": ["rdma-100g"]}}, "bad transport"),
    ("/admin/instances", {"url": "http://127.0.0.1:1", "transport": {"bandwidth_gbps": 0}}, "bandwidth_gbps"),
    ("/admin/instances", {"url": "http://127.0.0.1:1", "transport": {"bandwidth_gbps": -5}}, "bandwidth_gbps"),
    ("/admin/instances", {"url": "http://127.0.0.1:1", "transport": {"bandwidth_gbps": "nan"}}, "bandwidth_gbps"),
    ("/admin/instances", {"url": "http://127.0.0.1:1", "api_key": "k\n"}, "api_key"),  # would end an HTTP header
    ("/admin/instances", {"url": "http://127.0.0.1:1", "num_chips": 10 ** 30}, "num_chips"),
    ("/admin/instances", {"url": "http://127.0.0.1:1", "block_size": 2 ** 40}, "block_size"),
    ("/nodes/add", {"url": "http://127.0.0.1:7", "status": {"role": [2]}}, "unknown LMDeploy role"),
    ("/nodes/add", {"url": "http://127.0.0.1:7", "status": {"role": {"x": 1}}}, "unknown LMDeploy role"),
])
def test_admin_bodies_out_of_range_are_400_and_routing_goes_on(lt, path, body, needle):
    """Admin bodies that once got 500 or were accepted and then broke routing: a body nested too deeply, a heartbeat
    count beyond 2**31 (a 401-digit one was accepted and made every request under least_load a 500: the score
    overflowed a float), a transport with a list for its link or a bandwidth of 0, below 0 or NaN (0 made every PD
    placement under the cost policy a 500; NaN won every placement), an api_key ending in a newline (``$`` matched
    before it; it becomes a header of every request to the engine), an LMDeploy role that is a list or an object.
    Each is 400 with the reason; nothing registered; client requests still answered."""
    e = MockEngine(name="a")
    st = Setup(lt, [e], policy="least_load")
    try:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        with httpx.Client(timeout=LIVE) as h:
            r = h.post(st.base + path, content=raw, headers={"content-type": "application/json"})
            assert r.status_code == 400, r.text
            assert needle in r.json()["error"]["message"], r.text
            assert [i["id"] for i in h.get(st.base + "/admin/instances").json()["instances"]] == ["i0"]
            assert h.post(st.base + "/v1/completions", json=BODY).status_code == 200
    finally:
        st.close()


@pytest.mark.parametrize("prompt", [[-5] * 40, [10 ** 20] * 40, [[1, 2, 3, 2 ** 64] * 10]])
def test_token_id_prompts_out_of_range_are_400(lt, prompt):
    """A token-id prompt with a negative id or one beyond 2**63 - 1 is 400 naming the prompt (was 500 from the
    block hashing under the default cost policy); the engine never sees it."""
    e = MockEngine(name="a")
    st = Setup(lt, [e], policy="cost")
    try:
        with httpx.Client(timeout=LIVE) as h:
            r = h.post(st.base + "/v1/completions", json={"model": "mock", "prompt": prompt, "max_tokens": 2})
            assert r.status_code == 400, r.text
            assert "$.prompt" in r.json()["error"]["message"], r.text
            assert not e.received
    finally:
        st.close()


def test_the_token_encoding_cache_is_bounded():
    """The block hashes' per-token encoding cache keeps at most ``_ENC_CACHE_MAX`` entries: token ids come from
    clients, and every distinct one was kept forever (600,000 entries after three requests)."""
    from dlmix.routing import hashing

    start = 2 ** 40
    for t in range(start, start + hashing._ENC_CACHE_MAX + 1000):
        assert hashing._cbor_token(t) == hashing._cbor_uint(t)
    assert len(hashing._enc_cache) <= hashing._ENC_CACHE_MAX


# ------------------------------------------------------------------------------------ a client that does not read
@pytest.mark.parametrize("fast_path", [True, False])
def test_a_client_that_does_not_read_holds_the_backend_not_router_memory(lt, fast_path):
    """A client asks for a long streamed answer (30,000 events, about 3 MB) and reads nothing: once its connection's
    write buffer passes asyncio's high-water mark the router stops reading the backend (backpressure), so the router
    holds at most a few hundred KiB for it instead of the whole answer, and another client is served meanwhile.
    When the client reads, the answer arrives whole. Before, the router read the backend at full speed and buffered
    everything for the client."""
    e = MockEngine(name="a")
    st = Setup(lt, [e], fast_path=fast_path)
    s = socket.socket()
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # the kernel holds little for it either
        s.connect(("127.0.0.1", st.port))
        body = json.dumps({"model": "mock", "prompt": "hi", "max_tokens": 30_000, "stream": True}).encode()
        s.sendall(HEAD + b"content-length: %d\r\n\r\n" % len(body) + body)

        def client_conn():
            return next((c for c in st.router.hub.conns if c.backends or c.transport.get_write_buffer_size()), None)

        def buffered() -> int:
            c = client_conn()
            return c.transport.get_write_buffer_size() if c is not None else -1

        poll(lambda: buffered() > 0, timeout_s=LIVE)
        time.sleep(2.0)  # had it kept reading the backend, the buffer would hold megabytes by now
        print("router buffered for the client:", buffered(), "B")
        assert 0 < buffered() < 1 << 20, buffered()
        c = client_conn()
        assert c.write_paused and any(b.held for b in c.backends)
        with httpx.Client(timeout=LIVE) as h:  # others are served meanwhile
            assert h.post(st.base + "/v1/completions", json=BODY).status_code == 200
        s.settimeout(LIVE)
        got = bytearray()
        while not got.endswith(b"0\r\n\r\n"):
            chunk = s.recv(1 << 16)
            assert chunk, "connection closed before the answer ended"
            got += chunk
        text = bytes(got)
        assert text.startswith(b"HTTP/1.1 200") and text.count(b"data: ") == 30_000 + 1  # every event, then [DONE]
        assert b"data: [DONE]" in text
    finally:
        s.close()
        st.close()


def test_a_leg_cancelled_as_its_connection_opens_sends_nothing(lt):
    """A PD leg cancelled in the same loop step as its backend connection opens (a failed decode leg cancels the
    prefill leg; more likely on a loaded machine): Python 3.11's ``wait_for`` returned the connection and lost the
    cancellation, so the prefill request went out for nobody and ran on its engine until it finished (a mock
    prefill with a 30 s TTFT stayed in flight, failing tests/test_router_sglang_flow.py under load). Now the leg is
    cancelled and the backend sees a connection closed with no request on it."""
    from dlmix.router.proxy import Pool, build_request, request

    seen = []

    async def backend(reader, writer):
        seen.append(await reader.read(65536))
        writer.close()

    async def go():
        srv = await asyncio.start_server(backend, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        loop = asyncio.get_running_loop()
        real = loop.create_connection
        box = {}

        async def connect_then_cancel_the_leg(*a, **k):  # the cancel arrives as the connection completes
            out = await real(*a, **k)
            box["leg"].cancel()
            return out

        loop.create_connection = connect_then_cancel_the_leg
        try:
            box["leg"] = leg = asyncio.ensure_future(request(Pool("127.0.0.1", port, "p"), build_request(
                b"POST", b"/v1/completions", b"p", b"", b"{}"), timeout=10))
            await asyncio.wait((leg,), timeout=10)
        finally:
            del loop.create_connection
        for _ in range(200):  # the backend's handler reads until the router closes the connection
            if seen:
                break
            await asyncio.sleep(0.01)
        srv.close()
        return leg

    leg = lt.run(go())
    assert leg.cancelled()
    assert seen == [b""]  # connected, then closed without a request


# ---- review 4: the answers the HTTP layer makes itself (413, 414, 431, 408, 503 over max_connections, 400 for
# malformed HTTP) were missing from dlmix_router_client_responses_total, which the README says counts "every answer
# a client got, by exact status (the backends' and the router's own 400/401/404/413/502/503/508)"
def _answers(h, base) -> dict:
    out = {}
    for line in h.get(base + "/metrics").text.splitlines():
        if line.startswith("dlmix_router_client_responses_total{"):
            out[int(line.split('"')[1])] = float(line.rsplit(" ", 1)[1])
    return out


def test_http_layer_refusals_are_counted_as_client_answers(lt):
    st = Setup(lt, [MockEngine(name="a")], max_body_mb=1, header_timeout_s=0.3, max_connections=4)
    try:
        with httpx.Client(timeout=LIVE) as h:
            assert h.post(st.base + "/v1/completions?" + "a" * 9000, json=BODY).status_code == 414
            assert h.post(st.base + "/v1/completions", json=BODY,
                          headers={f"x-h{k}": "1" for k in range(150)}).status_code == 431
            assert h.post(st.base + "/v1/completions", json=dict(BODY, prompt="x" * (2 << 20))).status_code == 413
        s = st.sock()
        s.sendall(b"GET / HTTP/1.1\r\n")  # a head that never ends: 408
        assert _read_response(s)[0] == 408
        s.close()
        s = st.sock()
        s.sendall(b"\x00\x01 not http\r\n\r\n")  # malformed: 400
        assert _read_response(s)[0] == 400
        s.close()
        held = [st.sock() for _ in range(4)]  # max_connections open: the next one is answered 503
        time.sleep(0.1)
        extra = st.sock()
        assert _read_response(extra)[0] == 503
        extra.close()
        for s in held:
            s.close()
        with httpx.Client(timeout=LIVE) as h:
            seen = poll(lambda: (lambda a: a if all(a.get(k, 0) >= 1 for k in (400, 408, 413, 414, 431, 503))
                                 else None)(_answers(h, st.base)), timeout_s=LIVE)
            assert seen, _answers(h, st.base)
    finally:
        st.close()
