"""Fast tests of the vLLM plugin pieces that need no running engine: registration, settings validation, pair checks,
and the worker-side pull over a real dlmix TCP transport between two synthetic vLLM-CPU caches (block size and dtype
conversion, refusal, expiry, failure reporting)."""
from __future__ import annotations

import threading
import time

import pytest
import torch

pytest.importorskip("vllm")

from vllm.distributed.device_communicators import shm_broadcast  # noqa: E402
from vllm.distributed.device_communicators.shm_broadcast import SpinCondition  # noqa: E402

from dlmix.kv import KVLayout, ModelIdentity  # noqa: E402
from dlmix.kv.ops import read_kv, write_kv  # noqa: E402

from dlmix_vllm import CONNECTOR_NAME, register  # noqa: E402
from dlmix_vllm.config import DLMixConfigError, parse_settings  # noqa: E402
from dlmix_vllm.layout import check_pair, weights_fingerprint  # noqa: E402
from dlmix_vllm.transfer import KVEndpoint  # noqa: E402

SECRET = "unit-test-secret"


def _layout(bs: int, dtype: str, fp: str = "sha256:aa", layers: int = 3, heads: int = 2, d: int = 32) -> KVLayout:
    ident = ModelIdentity("LlamaForCausalLM", layers, heads, d, "gqa", weights_fingerprint=fp)
    return KVLayout(model=ident, block_size=bs, dtype=dtype, arrangement="vllm_cpu")


def _caches(lay: KVLayout, num_blocks: int) -> list[torch.Tensor]:
    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[lay.dtype]
    return [torch.zeros(lay.layer_shape(num_blocks), dtype=dt) for _ in range(lay.model.num_layers)]


def _fill(lay: KVLayout, caches, block_ids, n: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    ref = {}
    for t in range(n):
        for layer in range(lay.model.num_layers):
            k = torch.randn(lay.num_local_heads, lay.model.head_size, generator=g)
            v = torch.randn(lay.num_local_heads, lay.model.head_size, generator=g)
            write_kv(lay, caches, block_ids, t, layer, k, v)
            ref[(t, layer)] = (k, v)
    return ref


def test_register_is_idempotent_and_resolvable():
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    register()
    assert register() is False  # second call in the same process: guarded, no ValueError
    cls = KVConnectorFactory.get_connector_class_by_name(CONNECTOR_NAME)
    assert cls.__name__ == "DLMixConnector"


def test_entry_point_declared():
    from importlib.metadata import entry_points

    eps = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert eps.get("dlmix") == "dlmix_vllm:register"


def test_cpu_aid_computes_slow_16bit_prefill_products_in_fp32(monkeypatch):
    """``DLMIX_VLLM_CPU_AIDS``: a bf16 linear layer that vLLM CPU prepares through ``dispatch_cpu_unquantized_gemm``
    keeps its weight and computes a product of 16 rows or more in fp32 (rounded to bf16 once: exactly
    ``linear_fp32``), a product of fewer rows with vLLM's own kernel; an fp32 layer is left to vLLM. bf16 counts as
    slow here on any CPU (the check of which dtypes are slow is tests/test_testing_helpers.py's)."""
    import dlmix_vllm
    from vllm.model_executor.layers import utils

    import dlmix.testing.cpu_gemm as cg

    monkeypatch.setattr(utils, "dispatch_cpu_unquantized_gemm", utils.dispatch_cpu_unquantized_gemm)  # restored
    monkeypatch.setattr(SpinCondition, "wait", SpinCondition.wait)  # cpu_aids() also installs _no_spin_waits
    monkeypatch.setattr(cg, "slow_gemm_dtypes", lambda: frozenset({torch.bfloat16}))
    calls = []
    monkeypatch.setattr(cg, "linear_fp32", lambda x, w, b=None: calls.append(tuple(x.shape)) or
                        torch.nn.functional.linear(x.float(), w.float()).to(x.dtype))
    native = utils.dispatch_cpu_unquantized_gemm
    assert dlmix_vllm.cpu_aids() is True and dlmix_vllm.cpu_aids() is False

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        layer, ref = torch.nn.Module(), torch.nn.Module()
        w = torch.randn(48, 32, generator=g).to(dtype)
        layer.weight = torch.nn.Parameter(w.clone(), requires_grad=False)
        ref.weight = torch.nn.Parameter(w.clone(), requires_grad=False)
        utils.dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
        native(ref, remove_weight=False)
        assert layer.weight.numel() == w.numel() or dtype == torch.float32
        for rows in (3, 16, 40):
            x = torch.randn(rows, 32, generator=g).to(dtype)
            calls.clear()
            got = layer.cpu_linear(x, layer.weight, None)
            aided = dtype == torch.bfloat16 and rows >= cg.UPCAST_MIN_ROWS
            assert calls == ([(rows, 32)] if aided else []), (dtype, rows, calls)
            want = (torch.nn.functional.linear(x.float(), w.float()).to(dtype) if aided
                    else ref.cpu_linear(x, ref.weight, None))
            assert got.dtype == dtype and torch.equal(got, want), (dtype, rows)


def test_cpu_aid_makes_a_waiting_vllm_process_sleep_instead_of_spinning(monkeypatch):
    """``DLMIX_VLLM_CPU_AIDS`` (:func:`dlmix_vllm._no_spin_waits`): a reader of vLLM's shared-memory message queue
    (as a worker waits for the scheduler's next step) that waits 0.8 s for the next message right after reading one
    never calls ``sched_yield``, uses under 0.15 s of CPU (measured ~0.05 s: naps of 0.5 ms), and still gets the
    message. Without the aid the same wait spins on ``sched_yield`` (vLLM's 1 s busy loop; ~0.8 s of CPU on an idle
    machine, less on a loaded one, so the control counts the yields)."""
    import dlmix_vllm

    monkeypatch.setattr(SpinCondition, "wait", getattr(SpinCondition.wait, "__wrapped__", SpinCondition.wait))
    yields = []
    real_yield = shm_broadcast.sched_yield
    monkeypatch.setattr(shm_broadcast, "sched_yield", lambda: yields.append(threading.get_ident()) or real_yield())

    def wait_for_second() -> tuple[int, float]:
        """(sched_yield calls, CPU seconds) of this thread while it waits 0.8 s for the second message."""
        writer = shm_broadcast.MessageQueue(n_reader=1, n_local_reader=1)
        box = {}
        t = threading.Thread(target=lambda: box.update(
            r=shm_broadcast.MessageQueue.create_from_handle(writer.export_handle(), 0)) or box["r"].wait_until_ready())
        t.start()
        writer.wait_until_ready()
        t.join()
        reader = box["r"]
        try:
            writer.enqueue("first")
            assert reader.dequeue(timeout=10) == "first"
            later = threading.Timer(0.8, writer.enqueue, ("second",))
            later.start()
            yields.clear()
            c0 = time.thread_time()
            assert reader.dequeue(timeout=10) == "second"
            cpu_s = time.thread_time() - c0
            later.join()
            return yields.count(threading.get_ident()), cpu_s
        finally:
            reader.shutdown()
            writer.shutdown()

    spun, _ = wait_for_second()
    assert spun > 0
    dlmix_vllm._no_spin_waits()
    assert SpinCondition.wait.dlmix_cpu_aid
    napped, cpu_s = wait_for_second()
    assert napped == 0 and cpu_s < 0.15, (napped, cpu_s, spun)


def test_settings_defaults_and_errors():
    s = parse_settings(None)
    assert (s.transport, s.host, s.staging_bytes, s.verify_weights) == ("tcp", "127.0.0.1", 64 << 20, True)
    with pytest.raises(DLMixConfigError, match="hold_timeout_s"):
        parse_settings({"hold_timeout_s": -1})
    with pytest.raises(DLMixConfigError, match="bogus"):
        parse_settings({"bogus": 1})
    with pytest.raises(DLMixConfigError, match="shared_secret"):
        parse_settings({"host": "10.1.2.3"})
    assert parse_settings({"host": "10.1.2.3", "shared_secret": "x"}).host == "10.1.2.3"
    with pytest.raises(DLMixConfigError, match="transport"):
        parse_settings({"transport": "carrier-pigeon"})
    with pytest.raises(DLMixConfigError, match="public_url"):
        parse_settings({"router_url": "http://127.0.0.1:9000"})
    # the weights check is turned off only by a JSON false: "no", "off" or 0 is refused, not read as false
    assert parse_settings({"verify_weights": False}).verify_weights is False
    for v in ("no", "off", 0):
        with pytest.raises(DLMixConfigError, match="verify_weights"):
            parse_settings({"verify_weights": v})


def test_check_pair_reasons():
    a = _layout(32, "bf16")
    assert check_pair(a, _layout(128, "fp32")) == []  # block size and dtype are converted
    r = check_pair(a, _layout(128, "bf16", fp="sha256:bb"))
    assert len(r) == 1 and "fingerprint" in r[0]
    assert check_pair(a, _layout(128, "bf16", fp="sha256:bb"), verify_weights=False) == []
    r = check_pair(a, _layout(32, "bf16", layers=4))
    assert any("layers" in x for x in r)
    assert check_pair({"nonsense": 1}, a)[0].startswith("malformed")


def test_weights_fingerprint_sees_weight_changes(tmp_path):
    from safetensors.torch import save_file

    w = {"a": torch.arange(100000, dtype=torch.float32)}
    (tmp_path / "m1").mkdir()
    (tmp_path / "m2").mkdir()
    (tmp_path / "m1" / "config.json").write_text('{"x": 1}')
    (tmp_path / "m2" / "config.json").write_text('{"x": 1}')
    save_file(w, str(tmp_path / "m1" / "model.safetensors"))
    save_file({"a": w["a"] * 1.001}, str(tmp_path / "m2" / "model.safetensors"))
    f1, f2 = weights_fingerprint(str(tmp_path / "m1")), weights_fingerprint(str(tmp_path / "m2"))
    assert f1.startswith("sha256:") and f1 != f2
    assert f1 == weights_fingerprint(str(tmp_path / "m1"))
    assert weights_fingerprint("org/name") == "name:org/name"


@pytest.fixture()
def pair():
    made = []

    def mk(src_lay, dst_lay, src_blocks=16, dst_blocks=8, staging=1 << 20, hold_timeout_s=30.0,
           registration_wait_s=1.0):
        sc, dc = _caches(src_lay, src_blocks), _caches(dst_lay, dst_blocks)
        p = KVEndpoint("tcp", f"p-{len(made)}", SECRET, "127.0.0.1", 0, src_lay, sc, 0,
                       hold_timeout_s=hold_timeout_s, registration_wait_s=registration_wait_s, io_timeout_s=10.0)
        d = KVEndpoint("tcp", f"d-{len(made)}", SECRET, "127.0.0.1", 0, dst_lay, dc, staging,
                       registration_wait_s=registration_wait_s, io_timeout_s=10.0)
        made.extend([p, d])
        return p, d, sc, dc

    yield mk
    for e in made:
        e.close()


def test_pull_converts_block_size_and_dtype_and_moves_only_missing_blocks(pair):
    src, dst = _layout(32, "bf16"), _layout(128, "fp32")
    page = 2 * 32 * 2 * 32 * 2  # bytes of one block of one layer: 2 heads * 32 tokens * (K+V) * 32 * 2 bytes
    p, d, sc, dc = pair(src, dst, staging=3 * 3 * page)  # room for 3 prefill blocks (3 layers) per round
    n = 300
    src_blocks = [5, 6, 7, 2, 3, 9, 10, 11, 12, 13]  # 10 blocks of 32 cover 300 tokens
    ref = _fill(src, sc, src_blocks, n)
    p.add_hold("req-1", src_blocks, n)
    dst_blocks = [4, 1, 6]  # 3 blocks of 128
    start = 128  # decode already holds the first 128 tokens in its prefix cache
    res = d.pull(p.descriptor(), "req-1", src_blocks, start, n, dst_blocks)
    assert res.error is None, res.error
    assert res.loaded_upto == n
    # prefill blocks 4..9 (tokens 128..319) over 3 layers
    assert res.bytes_received == 6 * 3 * page
    assert res.rounds == 2 and res.peak_staging_bytes == 3 * 3 * page
    for t in (0, 127):
        k, _ = read_kv(dst, dc, dst_blocks, t, 0)
        assert torch.count_nonzero(k) == 0  # the decode's own prefix was not touched
    for t in (128, 200, 299):
        for layer in range(3):
            k, v = read_kv(dst, dc, dst_blocks, t, layer)
            rk, rv = ref[(t, layer)]
            assert torch.equal(k, rk.to(torch.bfloat16).float()) and torch.equal(v, rv.to(torch.bfloat16).float())
    p._handle(d.t.name, {"type": "blocks_consumed", "req": "req-1"})  # the peer that read it
    assert p.take_finished() == {"req-1"}


def test_pull_refused_for_other_weights_and_unknown_request(pair):
    p, d, sc, dc = pair(_layout(32, "bf16"), _layout(32, "bf16", fp="sha256:other"))
    p.add_hold("r", [0, 1], 40)
    res = d.pull(p.descriptor(), "r", [0, 1], 0, 40, [0, 1])
    assert res.loaded_upto == 0 and "fingerprint" in res.error
    p2, d2, _, _ = pair(_layout(32, "bf16"), _layout(32, "bf16"))
    res = d2.pull(p2.descriptor(), "nope", [0], 0, 10, [0])
    assert res.loaded_upto == 0 and "not held" in res.error


def test_hold_expires_and_dead_prefill_fails_fast(pair):
    p, d, _, _ = pair(_layout(32, "bf16"), _layout(32, "bf16"), hold_timeout_s=0.2)
    p.add_hold("ok", [1], 10)
    assert d.pull(p.descriptor(), "ok", [1], 0, 10, [1]).error is None  # D now has a live connection to P
    p.add_hold("r", [0], 10)
    time.sleep(0.3)
    assert p.take_finished() == {"r"}  # expired; "ok" is kept: a read began (deadline >= now + io_timeout_s)
    desc = p.descriptor()
    p.close()  # like a killed prefill: its sockets close
    res = d.pull(desc, "r", [0], 0, 10, [0])
    assert res.error is not None and res.loaded_upto == 0
    assert "Timeout" not in res.error  # detected as a dead peer, not by waiting out the timeout


def test_want_waits_for_hold_registration(pair):
    # the hold arrives 0.3 s after the want; the producer waits up to 60 s for it (generous: loaded machines)
    p, d, sc, dc = pair(_layout(32, "bf16"), _layout(32, "bf16"), registration_wait_s=60.0)
    _fill(_layout(32, "bf16"), sc, [3], 20)
    threading.Timer(0.3, p.add_hold, args=("late", [3], 20)).start()
    res = d.pull(p.descriptor(), "late", [3], 0, 20, [2])
    assert res.error is None and res.loaded_upto == 20
    assert torch.equal(dc[1][2], sc[1][3])  # same layout: identical bytes in the page


def test_router_client_registers_and_heartbeats():
    """RouterClient against a stub of the router's admin API (POST /admin/instances, .../heartbeat)."""
    import json as _json
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from types import SimpleNamespace

    from dlmix_vllm.router_client import RouterClient

    got: list[tuple[str, dict]] = []

    class H(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            body = _json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            got.append((self.path, body))
            code, out = (201, {"id": "inst-1"}) if self.path == "/admin/instances" else (200, {"ok": True})
            data = _json.dumps(out).encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    settings = parse_settings({"router_url": f"http://127.0.0.1:{srv.server_address[1]}",
                               "public_url": "http://127.0.0.1:8100", "heartbeat_s": 0.1,
                               "chip_profile": "cpu-x86"})
    lay = _layout(128, "bf16").to_dict()
    vcfg = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(engine_id="e1", kv_role="kv_producer"),
        model_config=SimpleNamespace(served_model_name="smollm2", model="/m"),
        kv_events_config=SimpleNamespace(enable_kv_cache_events=True, publisher="zmq", endpoint="tcp://*:5557"))
    rc = RouterClient(settings, vcfg, lay, {0: {"kind": "tcp", "host": "127.0.0.1", "port": 1}},
                      lambda: {"waiting": 2, "running": 1, "kv_usage": 0.25})
    rc.start()
    try:
        assert rc.registered.wait(60)
        deadline = time.monotonic() + 60
        while sum(p.endswith("/heartbeat") for p, _ in got) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        rc.stop()
        srv.shutdown()
    reg = got[0][1]
    assert got[0][0] == "/admin/instances"
    assert reg["role"] == "prefill" and reg["url"] == "http://127.0.0.1:8100" and reg["model"] == "smollm2"
    assert reg["kv_events"] == "tcp://127.0.0.1:5557" and reg["chip"] == "cpu-x86" and reg["block_size"] == 128
    assert KVLayout.from_dict(reg["kv_layout"]) == _layout(128, "bf16")
    assert reg["transport"]["port"] == 1
    hb = [b for p, b in got if p == "/admin/instances/inst-1/heartbeat"]
    assert hb[0] == {"waiting": 2, "running": 1, "kv_usage": 0.25}


@pytest.fixture(scope="module")
def sched_factory(tiny_model_dir):
    """Build scheduler-side DLMixConnectors from a real VllmConfig of the tiny model (no engine started)."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.engine.arg_utils import EngineArgs

    from dlmix_vllm.connector import DLMixConnector, DLMixHandshake

    register()

    def make(role: str, extra: dict | None = None, block_size: int = 32):
        ktc = KVTransferConfig(kv_connector="DLMixConnector", kv_role=role, kv_connector_extra_config=extra or {})
        cfg = EngineArgs(model=str(tiny_model_dir), enforce_eager=True, block_size=block_size, max_model_len=1024,
                         kv_transfer_config=ktc).create_engine_config()
        c = DLMixConnector(cfg, KVConnectorRole.SCHEDULER, None)
        c.set_xfer_handshake_metadata({0: DLMixHandshake(transport={"kind": "tcp", "name": "w0", "host": "127.0.0.1",
                                                                    "port": 5555, "regions": {}}, layout={})})
        return c

    return make


def _req(rid, params, n_prompt, status=None, computed=0):
    from types import SimpleNamespace

    from vllm.v1.request import RequestStatus

    return SimpleNamespace(request_id=rid, kv_transfer_params=params, num_prompt_tokens=n_prompt,
                           num_computed_tokens=computed, status=status or RequestStatus.RUNNING)


def test_scheduler_side_prefill_and_decode_bookkeeping(sched_factory):
    from types import SimpleNamespace

    from vllm.v1.request import RequestStatus

    p = sched_factory("kv_producer")
    done = _req("p1", {"do_remote_decode": True}, 300, RequestStatus.FINISHED_LENGTH_CAPPED, computed=300)
    delay, params = p.request_finished(done, list(range(10)))
    assert delay is True and params["remote_num_tokens"] == 300 and params["remote_block_ids"] == list(range(10))
    assert params["remote_transports"][0]["port"] == 5555 and params["remote_layout"]["block_size"] == 32
    aborted = _req("p2", {"do_remote_decode": True}, 300, RequestStatus.FINISHED_ABORTED, computed=120)
    assert p.request_finished(aborted, [1, 2, 3, 4]) == (False, None)
    meta = p.build_connector_meta(None)
    assert set(meta.holds) == {"p1"} and meta.holds["p1"] == (list(range(10)), 300)
    assert p.build_connector_meta(None).holds == {}  # per-step state is reset

    d = sched_factory("kv_consumer", block_size=128)
    assert d._kv_transfer_config.kv_load_failure_policy == "recompute"
    r = _req("d1", dict(params), 300)
    assert d.get_num_new_matched_tokens(r, 128) == (172, True)
    assert d.get_num_new_matched_tokens(r, 128) == (172, True)  # side-effect free
    blocks = SimpleNamespace(get_block_ids=lambda: ([7, 8, 9],))
    d.update_state_after_alloc(r, blocks, 172)
    job = d.build_connector_meta(None).recvs[0]
    assert (job.start, job.end, job.local_block_ids, job.remote_block_ids) == (128, 300, [7, 8, 9], list(range(10)))
    r.status = RequestStatus.FINISHED_LENGTH_CAPPED
    delay, out = d.request_finished(r, [7, 8, 9])
    assert delay is False and out["dlmix"]["local_hit_tokens"] == 128 and out["dlmix"]["loaded_tokens"] == 172

    # a prefill with other weights is refused: nothing claimed, P told to free, reason in the response
    other = dict(params, remote_layout={**params["remote_layout"],
                                        "model": {**params["remote_layout"]["model"], "weights_fingerprint": "x"}})
    r2 = _req("d2", other, 300)
    assert d.get_num_new_matched_tokens(r2, 0) == (0, False)
    d.update_state_after_alloc(r2, SimpleNamespace(get_block_ids=lambda: ([],)), 0)
    meta = d.build_connector_meta(None)
    assert meta.recvs == [] and meta.releases[0].remote_req_id == "p1" and meta.releases[0].consumed is False
    r2.status = RequestStatus.FINISHED_STOPPED
    assert "fingerprint" in d.request_finished(r2, [])[1]["dlmix"]["refused"]

    # aborted on D before allocation: P is told to free at once
    r3 = _req("d3", dict(params), 300, RequestStatus.FINISHED_ABORTED)
    assert d.request_finished(r3, [])[0] is False
    assert d.build_connector_meta(None).releases[0].remote_req_id == "p1"


def test_a_decode_instance_holds_nothing_for_a_client_asking_do_remote_decode(sched_factory):
    """A client may send ``{"do_remote_decode": true}`` to a kv_consumer: it knows the worker transports too (their
    handshakes), but only a producer's worker ever reports ``finished_sending``, so a hold made there would keep the
    request's blocks for ever. Nothing is held and vLLM frees the blocks at once; a producer still holds."""
    from vllm.v1.request import RequestStatus

    d = sched_factory("kv_consumer")
    r = _req("c1", {"do_remote_decode": True}, 64, RequestStatus.FINISHED_LENGTH_CAPPED, computed=64)
    assert d.request_finished(r, [3, 4]) == (False, None)
    assert d.build_connector_meta(None).holds == {}
    p = sched_factory("kv_producer")
    assert p.request_finished(r, [3, 4])[0] is True and set(p.build_connector_meta(None).holds) == {"c1"}


def test_n_children_sharing_one_params_dict_each_pull(sched_factory):
    """With the engine in process, vLLM's ``n`` child requests share their parent's ``kv_transfer_params`` dict (a
    shallow copy of the sampling params): the first child's allocation must not turn the others' remote prefill
    off. Each child claims and gets its own receive job; the shared dict is left as the client sent it."""
    from types import SimpleNamespace

    from vllm.v1.request import RequestStatus

    p = sched_factory("kv_producer")
    done = _req("p1", {"do_remote_decode": True}, 300, RequestStatus.FINISHED_LENGTH_CAPPED, computed=300)
    shared = p.request_finished(done, list(range(10)))[1]
    d = sched_factory("kv_consumer", block_size=128)
    kids = [_req(f"c{i}", shared, 300) for i in range(2)]
    for r in kids:
        assert d.get_num_new_matched_tokens(r, 0) == (300, True)
        d.update_state_after_alloc(r, SimpleNamespace(get_block_ids=lambda: ([1, 2, 3],)), 300)
    assert [j.req_id for j in d.build_connector_meta(None).recvs] == ["c0", "c1"]
    assert shared["do_remote_prefill"] is True and "_dlmix_consumer" not in shared


def test_cancelled_pull_stops_between_rounds_and_prefill_frees(pair):
    src = _layout(32, "bf16")
    page = 2 * 32 * 2 * 32 * 2
    p, d, sc, dc = pair(src, src, staging=3 * page)  # one prefill block (3 layers) per round
    _fill(src, sc, [0, 1, 2], 96)
    p.add_hold("c", [0, 1, 2], 96)
    rounds = []
    res = d.pull(p.descriptor(), "c", [0, 1, 2], 0, 96, [3, 4, 5], cancelled=lambda: len(rounds) > 0 or
                 rounds.append(1) is not None and False)
    assert res.error is not None and "cancelled" in res.error
    assert res.loaded_upto == 32 and res.rounds == 1  # stopped at the round boundary, nothing written after
    assert torch.count_nonzero(dc[0][4]) == 0
    d.release(p.descriptor(), "c", consumed=False)
    deadline = time.monotonic() + 60
    while not p.take_finished() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not p.is_held("c")


def test_worker_reports_failed_blocks_for_dead_prefill(tiny_model_dir):
    """Worker side of the connector: a pull from an unreachable prefill finishes the request and reports exactly
    the blocks it should have filled, so vLLM recomputes them."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.engine.arg_utils import EngineArgs

    from dlmix_vllm.connector import DLMixConnector, DLMixConnectorMetadata, RecvJob

    register()
    ktc = KVTransferConfig(kv_connector="DLMixConnector", kv_role="kv_consumer",
                           kv_connector_extra_config={"connect_timeout_s": 2, "io_timeout_s": 2})
    cfg = EngineArgs(model=str(tiny_model_dir), enforce_eager=True, block_size=32, max_model_len=1024,
                     dtype="float32", kv_transfer_config=ktc).create_engine_config()
    w = DLMixConnector(cfg, KVConnectorRole.WORKER, None)
    lay = _layout(32, "fp32", layers=2, heads=2, d=32)
    w.register_kv_caches({f"model.layers.{i}.self_attn.attn": torch.zeros(lay.layer_shape(16)) for i in range(2)})
    try:
        assert w.layout.block_size == 32 and w.layout.dtype == "fp32" and w.layout.model.num_layers == 2
        meta = DLMixConnectorMetadata()
        dead = {"kind": "tcp", "proto": "dlmix-kv/1", "name": "gone", "host": "127.0.0.1", "port": 1, "regions": {}}
        meta.recvs.append(RecvJob("req", [9, 3, 5, 7], 40, 120, [dead], "remote-req", [0, 1, 2, 3]))
        w.bind_connector_metadata(meta)
        deadline = time.monotonic() + 120
        res = w.get_transfer_results(set())
        while not res.finished_recving and time.monotonic() < deadline:
            time.sleep(0.05)
            res = w.get_transfer_results(set())
        assert res.finished_recving == {"req"}
        # tokens 40..119 were to be loaded: blocks at positions 1..3 (block 0 = the local prefix hit stays valid)
        assert w.get_block_ids_with_load_errors() == {3, 5, 7}
        assert w.get_block_ids_with_load_errors() == set()  # reported once
        rec = w.build_connector_worker_meta().transfers["req"]
        assert rec["failed_blocks"] == 3 and rec["error"]
        st = w.get_kv_connector_stats()
        assert st.data["failed"] == [1] and st.data["tokens_loaded"] == [0]
    finally:
        w.shutdown()


def test_registration_body_accepted_by_dlmix_router():
    """The body RouterClient posts is accepted by the real router's registration (prefill + decode pair)."""
    from types import SimpleNamespace

    from dlmix.router.config import RouterConfig
    from dlmix.router.server import Router
    from dlmix_vllm.router_client import registration_body

    router = Router(RouterConfig())
    for role, port, bs in (("kv_producer", 8100, 32), ("kv_consumer", 8101, 128)):
        s = parse_settings({"router_url": "http://127.0.0.1:9", "public_url": f"http://127.0.0.1:{port}",
                            "chip_profile": "cpu-x86"})
        v = SimpleNamespace(kv_transfer_config=SimpleNamespace(engine_id=f"e{port}", kv_role=role),
                            model_config=SimpleNamespace(served_model_name="smollm2", model="/m"),
                            kv_events_config=None)
        body = registration_body(s, v, _layout(bs, "bf16").to_dict(),
                                 {0: {"kind": "tcp", "name": "w", "host": "127.0.0.1", "port": 5, "regions": {}}})
        st = router.register(body)
        assert (st.id, st.role, st.block_size) == (f"e{port}", "decode" if port == 8101 else "prefill", bs)


def test_worker_metadata_aggregates_over_tp_ranks():
    from dlmix_vllm.connector import DLMixWorkerMetadata

    a = DLMixWorkerMetadata({"r": {"bytes_received": 5, "rounds": 1, "failed_blocks": 0, "transfer_s": 0.1,
                                   "error": None}})
    b = DLMixWorkerMetadata({"r": {"bytes_received": 7, "rounds": 2, "failed_blocks": 3, "transfer_s": 0.3,
                                   "error": "x"}, "q": {"bytes_received": 1}})
    t = a.aggregate(b).transfers
    assert t["r"] == {"bytes_received": 12, "rounds": 3, "failed_blocks": 3, "transfer_s": 0.3, "error": "x",
                      "peak_staging_bytes": 0}
    assert t["q"] == {"bytes_received": 1}


def _mla_vllm_config(model_dir: str, *, cache_dtype: str = "auto", rope: int | None = 64):
    """A vLLM config as :func:`dlmix_vllm.layout.describe_engine` reads it, for an MLA model (DeepSeek-V2 style)."""
    from types import SimpleNamespace

    import torch

    hf = SimpleNamespace(kv_lora_rank=512, num_attention_heads=2, architectures=["DeepseekV2ForCausalLM"])
    if rope is not None:
        hf.qk_rope_head_dim = rope
    mc = SimpleNamespace(use_mla=True, dtype=torch.float32, hf_config=hf, hf_text_config=hf, model=model_dir,
                         get_num_layers=lambda pc: 2, get_total_num_kv_heads=lambda: 2, get_head_size=lambda: 192)
    return SimpleNamespace(model_config=mc, parallel_config=SimpleNamespace(tensor_parallel_size=2),
                           cache_config=SimpleNamespace(block_size=16, cache_dtype=cache_dtype))


def test_describe_engine_names_an_mla_model_one_latent_plane(tiny_deepseek_dir):
    """An MLA model is one latent plane of kv_lora_rank + rope elements and one KV head (not the config's attention
    heads or head size), arrangement ``mla`` before the workers report theirs; fp8 and an incomplete config are
    refused with the reason."""
    from dlmix_vllm.layout import describe_engine

    lay = describe_engine(_mla_vllm_config(str(tiny_deepseek_dir)), tp_rank=1)
    m = lay.model
    assert (m.attention, m.num_kv_heads, m.head_size, m.kv_lora_rank, m.rope_dim, m.num_layers) == \
        ("mla", 1, 576, 512, 64, 2)
    assert (lay.arrangement, lay.block_size, lay.dtype, lay.tp_size, lay.tp_rank) == ("mla", 16, "fp32", 2, 1)
    assert m.weights_fingerprint
    with pytest.raises(ValueError, match="MLA model is not supported"):
        describe_engine(_mla_vllm_config(str(tiny_deepseek_dir), cache_dtype="fp8"))
    with pytest.raises(ValueError, match="qk_rope_head_dim"):
        describe_engine(_mla_vllm_config(str(tiny_deepseek_dir), rope=None))


def test_connector_loggers_write_through_vllms_handler():
    """vLLM configures only its ``vllm`` logger: the connector's ``dlmix_vllm``/``dlmix`` INFO lines (a want that
    waited for its hold, a worker's transport) must reach vLLM's handler at vLLM's level, and loggers an application
    configured itself are left alone."""
    import io
    import logging

    from dlmix_vllm.connector import log_like_vllm

    vl, ours, core = (logging.getLogger(n) for n in ("vllm", "dlmix_vllm", "dlmix"))
    saved = [(lg, list(lg.handlers), lg.level, lg.propagate) for lg in (vl, ours, core)]
    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    handler.setLevel(logging.INFO)
    try:
        for lg in (vl, ours, core):
            lg.handlers = []
        vl.addHandler(handler)
        vl.setLevel(logging.DEBUG)
        mine = logging.StreamHandler(io.StringIO())
        core.addHandler(mine)  # configured by the application: kept as it is
        log_like_vllm()
        logging.getLogger("dlmix_vllm.worker").info("worker line")
        logging.getLogger("dlmix_vllm.worker").debug("debug line")
        assert buf.getvalue() == "worker line\n"  # INFO through vLLM's handler; DEBUG below its level
        assert ours.level == logging.INFO and ours.propagate is False
        assert core.handlers == [mine]
        log_like_vllm()  # idempotent: no second handler
        assert ours.handlers == [handler]
    finally:
        for lg, hs, lvl, prop in saved:
            lg.handlers, lg.propagate = hs, prop
            lg.setLevel(lvl)


def test_kv_both_request_with_remote_prefill_and_decode_leaves_no_record(sched_factory):
    """A kv_both instance given both do_remote_prefill and do_remote_decode (one request length-capped, one aborted)
    keeps no per-request transfer record after they finish (before, one stayed per such request for ever)."""
    from types import SimpleNamespace

    from vllm.v1.request import RequestStatus

    p = sched_factory("kv_producer")
    params = p.request_finished(_req("p1", {"do_remote_decode": True}, 300, RequestStatus.FINISHED_LENGTH_CAPPED,
                                     computed=300), list(range(10)))[1]
    d = sched_factory("kv_both")
    blocks = SimpleNamespace(get_block_ids=lambda: ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10],))
    for i, status in enumerate((RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_ABORTED)):
        r = _req(f"d{i}", dict(params, do_remote_decode=True), 300, RequestStatus.WAITING)
        d.on_new_request(r)
        n, _ = d.get_num_new_matched_tokens(r, 0)
        assert n == 300
        d.update_state_after_alloc(r, blocks, n)
        r.status, r.num_computed_tokens = status, 300
        d.request_finished(r, blocks.get_block_ids()[0])
    d.build_connector_meta(None)
    assert d.connector_scheduler._info == {}, d.connector_scheduler._info


@pytest.mark.parametrize("key, value", [("port", True), ("port", "8000"), ("staging_bytes", 1e20),
                                        ("staging_bytes", True), ("io_timeout_s", float("inf")),
                                        ("connect_timeout_s", float("inf")), ("hold_timeout_s", float("nan")),
                                        ("pull_threads", 0), ("pull_threads", True), ("pull_threads", 65)])
def test_settings_refuse_other_json_types_and_infinite_timeouts(key, value):
    """``{"port": true}`` was port 1, ``staging_bytes: 1e20`` and ``io_timeout_s: inf`` were accepted (an infinite
    timeout never fails a stalled transfer); each is refused with the key's name, and the same settings in core
    (:class:`dlmix.pd.settings.EndpointSettings`, SGLang and LMDeploy) refuse infinite timeouts too."""
    from dlmix.pd.settings import EndpointSettings

    with pytest.raises(DLMixConfigError, match=key):
        parse_settings({key: value})
    if key.endswith("_timeout_s"):
        with pytest.raises(ValueError, match=key):
            EndpointSettings(**{key: value})


@pytest.mark.parametrize("pull_threads", [4, 1])
def test_a_decode_worker_pulls_for_other_requests_while_one_prefill_does_not_answer(pull_threads):
    """A decode worker runs ``pull_threads`` pulls at once (their staging rounds take turns in the core): request
    ``b``'s pull completes while request ``a``'s prefill has not answered. Before, the worker had one pull thread, so
    ``b`` waited until ``a``'s connect and release timed out (2 x ``connect_timeout_s``); with ``pull_threads`` 1
    it still does (the control)."""
    from types import SimpleNamespace

    from dlmix.pd.consumer import PullResult
    from dlmix_vllm.metadata import DLMixConnectorMetadata, RecvJob
    from dlmix_vllm.worker import DLMixConnectorWorker

    unblock, silent_started = threading.Event(), threading.Event()

    class Endpoint:  # the core's pull: "silent" stands for a prefill that accepts and never answers
        def pull(self, remote, rid, rblocks, start, end, lblocks, cancelled, **kw):
            if rid == "silent":
                silent_started.set()
                unblock.wait(30)
                return PullResult(loaded_upto=start, error="TransferTimeout: silent", failed_block_ids=list(lblocks))
            return PullResult(loaded_upto=end, bytes_received=4096, rounds=1)

        def release(self, remote, rid, consumed):
            pass

        def close(self):
            pass

    settings = parse_settings({"pull_threads": pull_threads})
    w = DLMixConnectorWorker(SimpleNamespace(kv_transfer_config=None), None, settings, "e0")
    w.endpoint, w.layout = Endpoint(), SimpleNamespace(block_size=16)
    meta = DLMixConnectorMetadata()
    meta.recvs = [RecvJob("a", [1, 2], 0, 32, [{}], "silent", [5, 6]), RecvJob("b", [3], 0, 16, [{}], "ok", [7])]
    try:
        w.bind_connector_metadata(meta)
        assert silent_started.wait(10)
        done_b = lambda: "b" in w._records  # noqa: E731
        deadline = time.monotonic() + 5
        while not done_b() and time.monotonic() < deadline:
            time.sleep(0.01)
        if pull_threads == 1:
            assert not done_b() and "a" not in w._records  # b queued behind a's silent prefill
            unblock.set()
            deadline = time.monotonic() + 10
            while not done_b() and time.monotonic() < deadline:
                time.sleep(0.01)
        else:
            assert done_b() and "a" not in w._records, w._records  # b done while a still waits
        assert w._records["b"]["bytes_received"] == 4096 and w._records["b"]["loaded_tokens"] == 16
        assert w._records["b"]["error"] is None and w._records["b"]["failed_blocks"] == 0
    finally:
        unblock.set()
        w.shutdown()


def test_worker_shutdown_tells_every_prefill_to_drop_the_holds_of_its_running_and_queued_pulls():
    """vLLM shutting a decode worker down: its running pull is cancelled and releases its hold (consumed=False), its
    queued pulls start no transfer but release theirs, and a queued release is still sent, all before the endpoint
    closes. Before, shutdown cancelled the queued jobs silently and closed the endpoint under the running pull, so
    the prefill kept those blocks until its hold_timeout_s."""
    from types import SimpleNamespace

    from dlmix.pd.consumer import PullResult
    from dlmix_vllm.metadata import DLMixConnectorMetadata, ReleaseJob, RecvJob
    from dlmix_vllm.worker import DLMixConnectorWorker

    running = threading.Event()
    calls: list[tuple] = []

    class Endpoint:  # the core's pull: the prefill of "slow" answers only when the pull is cancelled
        def pull(self, remote, rid, rblocks, start, end, lblocks, cancelled, **kw):
            calls.append(("pull", rid))
            running.set()
            deadline = time.monotonic() + 20
            while not cancelled() and time.monotonic() < deadline:
                time.sleep(0.01)
            return PullResult(loaded_upto=start, error="cancelled", failed_block_ids=list(lblocks))

        def release(self, remote, rid, consumed):
            calls.append(("release", rid, consumed))

        def close(self):
            calls.append(("close",))

    w = DLMixConnectorWorker(SimpleNamespace(kv_transfer_config=None), None, parse_settings({"pull_threads": 1}),
                             "e0")
    w.endpoint, w.layout = Endpoint(), SimpleNamespace(block_size=16)
    meta = DLMixConnectorMetadata()
    meta.recvs = [RecvJob("a", [1], 0, 16, [{}], "slow", [5]), RecvJob("b", [2], 0, 16, [{}], "queued-1", [6]),
                  RecvJob("c", [3], 0, 16, [{}], "queued-2", [7])]
    meta.releases = [ReleaseJob([{}], "done-earlier", True)]
    w.bind_connector_metadata(meta)
    assert running.wait(10)
    w.shutdown()
    assert calls[-1] == ("close",)
    assert [c for c in calls if c[0] == "pull"] == [("pull", "slow")]  # queued pulls started no transfer
    assert sorted(c for c in calls if c[0] == "release") == [
        ("release", "done-earlier", True), ("release", "queued-1", False), ("release", "queued-2", False),
        ("release", "slow", False)]
    w.shutdown()  # idempotent
