"""dlmix bench against an in-test asyncio mock OpenAI server: counts, fake-clock timings, prefix-hit scrape, CLI."""
from __future__ import annotations

import asyncio
import json
import math
import threading

import httpx
import pytest
from typer.testing import CliRunner

from dlmix.bench.client import send_request
from dlmix.testing.mock_engine import MockEngine, serve
from dlmix.bench.runner import BenchSettings, Level, run_level
from dlmix.bench.scrape import parse_metrics, prefix_hit_rate
from dlmix.bench.workloads import shared_prefix


class FakeClock:
    """Returns 0, 1, 2, ... seconds on successive calls."""

    def __init__(self):
        self.t = -1.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


async def _with_server(eng: MockEngine, fn):
    server = await serve(eng, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        return await fn(f"http://127.0.0.1:{port}")
    finally:
        server.close()
        await server.wait_closed()


def test_stream_timing_with_fake_clock_and_usage_counts():
    eng = MockEngine(model="m", ttft=0.0, itl=0.0)

    async def go(url):
        async with httpx.AsyncClient() as c:
            return await send_request(c, url, "m", [11, 12, 13, 14, 15], 4, clock=FakeClock())

    r = asyncio.run(_with_server(eng, go))
    assert r.success, r.error
    assert (r.input_tokens, r.output_tokens) == (5, 4)
    # clock reads: send=0, chunks at 1,2,3,4, end=5
    assert r.ttft == 1.0 and r.itl == [1.0, 1.0, 1.0] and r.latency == 5.0
    assert r.tpot == pytest.approx((5.0 - 1.0) / 3)
    body = eng.bodies[0]
    assert body["prompt"] == [11, 12, 13, 14, 15] and body["max_tokens"] == 4
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True


def test_http_error_becomes_failed_result():
    async def go(url):
        async with httpx.AsyncClient() as c:
            return await send_request(c, url, "m", [1, 2], 2, endpoint="/v1/nope")

    r = asyncio.run(_with_server(MockEngine(), go))
    assert not r.success and r.error.startswith("HTTP 404")


def test_run_level_counts_concurrency_and_engine_prefix_hits():
    eng = MockEngine(model="m", ttft=0.002, itl=0.001, block_size=16)
    # 2 groups x 3 prompts, 32-token shared prefix (2 blocks) + 16-token suffix
    wl = shared_prefix(2, 3, prefix_len=32, suffix_len=16, output_len=3, seed=0)

    async def go(url):
        s = BenchSettings(base_url=url, engine_urls=[url], scrape_router=False, goodput_ms={"ttft": 60000})
        return await run_level(wl, Level(math.inf, 2), s, seed=0)

    out = asyncio.run(_with_server(eng, go))
    m = out["metrics"]
    assert out["model"] == "m"
    assert m["completed"] == 6 and m["failed"] == 0
    assert m["total_input_tokens"] == 6 * 48 and m["total_output_tokens"] == 18
    assert m["good_fraction"] == 1.0
    assert len(out["results"]) == 6
    # exact counters: the 2nd and 3rd prompt of each group hit the 32 prefix tokens
    p = out["prefix"]
    assert p["source"] == "engines"
    assert p["hit_tokens"] == 2 * 2 * 32 and p["query_tokens"] == 6 * 48
    assert p["rate"] == pytest.approx(128 / 288)
    assert eng.requests == 6


def test_prefix_hit_rate_prefers_router_pair_and_parses_prometheus():
    before = parse_metrics('vllm:prefix_cache_hits_total{model_name="a"} 10\n'
                           'vllm:prefix_cache_hits_total{model_name="b"} 5\nvllm:prefix_cache_queries_total 100\n')
    assert before == {"vllm:prefix_cache_hits_total": 15.0, "vllm:prefix_cache_queries_total": 100.0}
    after = {"vllm:prefix_cache_hits_total": 45.0, "vllm:prefix_cache_queries_total": 160.0}
    assert prefix_hit_rate(None, [(before, after)])["rate"] == pytest.approx(0.5)
    rb = {"dlmix_router_prefix_hit_tokens_total": 0.0, "dlmix_router_prefix_query_tokens_total": 0.0}
    ra = {"dlmix_router_prefix_hit_tokens_total": 30.0, "dlmix_router_prefix_query_tokens_total": 120.0}
    r = prefix_hit_rate((rb, ra), [(before, after)])
    assert r["source"] == "router" and r["rate"] == pytest.approx(0.25)
    assert prefix_hit_rate(None, [(None, None)])["rate"] is None


def _serve_in_thread(eng: MockEngine):
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    holder = {}

    def run():
        asyncio.set_event_loop(loop)
        holder["server"] = loop.run_until_complete(serve(eng, "127.0.0.1", 0))
        ready.set()
        loop.run_forever()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    ready.wait(10)
    port = holder["server"].sockets[0].getsockname()[1]

    def stop():
        loop.call_soon_threadsafe(loop.stop)
        t.join(5)

    return f"http://127.0.0.1:{port}", stop


def test_cli_sweep_writes_results_and_plots(tmp_path):
    from dlmix.cli import app

    eng = MockEngine(model="m", ttft=0.001, itl=0.0005)
    url, stop = _serve_in_thread(eng)
    try:
        for label in ("a", "b"):
            res = CliRunner().invoke(app, [
                "bench", "--url", url, "--request-rate", "50,100,inf", "--gsp-num-groups", "2",
                "--gsp-prompts-per-group", "2", "--gsp-system-prompt-len", "32", "--gsp-question-len", "8",
                "--gsp-output-len", "4", "--goodput", "ttft:60000", "--engine-url", url, "--seed", "5",
                "--output-dir", str(tmp_path), "--label", label])
            assert res.exit_code == 0, res.output
    finally:
        stop()
    data = json.loads((tmp_path / "a" / "results.json").read_text())
    assert [lv["level"]["label"] for lv in data["levels"]] == ["rate=50", "rate=100", "rate=inf"]
    assert all(lv["metrics"]["completed"] == 4 for lv in data["levels"])
    assert all(lv["metrics"]["total_output_tokens"] == 16 for lv in data["levels"])
    # each level uses a fresh seed (seed + i), so each level hits exactly 2 prompts x 32 tokens
    assert [lv["prefix"]["hit_tokens"] for lv in data["levels"]] == [64.0, 64.0, 64.0]
    lines = (tmp_path / "a" / "requests.jsonl").read_text().splitlines()
    assert len(lines) == 12
    assert eng.requests == 24
    for png in ("latency_vs_load.png", "throughput_vs_load.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert sorted(summary) == ["a", "b"]


def test_cli_rejects_bad_goodput():
    from dlmix.cli import app

    res = CliRunner().invoke(app, ["bench", "--goodput", "itl:5"])
    assert res.exit_code == 2
    assert _error_line(res.output) == "Invalid value: --goodput: unknown metric 'itl'; choose from ttft, tpot, e2el"


def _error_line(output: str) -> str:
    """The message of click's usage error, as one line (the rich error box unwrapped, or plain ``Error: ...``)."""
    import re

    text = re.sub(r"\x1b\[[0-9;]*m", "", output)
    at = text.index("Invalid value")
    lines = [ln.strip().strip("│").strip() for ln in text[at:].splitlines()]
    return " ".join(ln for ln in lines if ln and not ln.startswith("╰"))


@pytest.mark.parametrize("args, message", [
    (["--request-rate", "0"], "Invalid value for '--request-rate': must be > 0 or inf, got 0"),
    (["--request-rate", "-1"], "Invalid value for '--request-rate': must be > 0 or inf, got -1"),
    (["--request-rate", "2,inf,0"], "Invalid value for '--request-rate': must be > 0 or inf, got 0"),
    (["--request-rate", "nan"], "Invalid value for '--request-rate': must be > 0 or inf, got nan"),
    (["--request-rate", ","], "Invalid value for '--request-rate': needs at least one value"),
    (["--request-rate", "fast"], "Invalid value for '--request-rate': 'fast' is not a number"),
    (["--burstiness", "0"], "Invalid value for '--burstiness': must be > 0, got 0"),
    (["--burstiness", "-0.5"], "Invalid value for '--burstiness': must be > 0, got -0.5"),
    (["--max-concurrency", "-3"], "Invalid value for '--max-concurrency': must be >= 0 (0 = no limit), got -3"),
    (["--max-concurrency", "4,-1"], "Invalid value for '--max-concurrency': must be >= 0 (0 = no limit), got -1"),
    (["--max-concurrency", "1.5"], "Invalid value for '--max-concurrency': must be an integer >= 0, got '1.5'"),
    (["--max-concurrency", "inf"], "Invalid value for '--max-concurrency': must be an integer >= 0, got 'inf'"),
    (["--workload", "random", "--num-prompts", "0"], "Invalid value for '--num-prompts': must be >= 1, got 0"),
    (["--workload", "random", "--num-prompts", "-2"], "Invalid value for '--num-prompts': must be >= 1, got -2"),
    (["--num-prompts", "8"], "Invalid value for '--num-prompts': not used by shared-prefix; see --gsp-*"),
    (["--metric-percentiles", "50,101"], "Invalid value for '--metric-percentiles': must be in [0, 100], got 101"),
    (["--timeout", "0"], "Invalid value for '--timeout': must be > 0, got 0"),
    (["--request-rate", "trace"], "Invalid value for '--request-rate': 'trace' replays the timestamps of a trace: "
                                  "only with --workload mooncake, not 'shared-prefix'"),
    (["--request-rate", "trace,1"], "Invalid value for '--request-rate': 'trace' (the trace's own timestamps) must "
                                    "be given alone, not in a list"),
    (["--workload", "random", "--token-range", "abc"],
     "Invalid value for '--token-range': expected LO:HI (two integers), got 'abc'"),
])
def test_cli_refuses_out_of_range_load_flags_before_any_request(args, message):
    out = _refused_before_any_request(args)
    assert _error_line(out) == message


def _refused_before_any_request(args: list) -> str:
    """Run ``dlmix bench`` with ``args`` against a mock engine; assert it exits 2, without a traceback, having sent
    no request. Returns its output."""
    from dlmix.cli import app

    eng = MockEngine(model="m")
    url, stop = _serve_in_thread(eng)
    try:
        res = CliRunner().invoke(app, ["bench", "--url", url, *args])
    finally:
        stop()
    assert res.exit_code == 2, res.output
    assert isinstance(res.exception, SystemExit) and "Traceback" not in res.output
    assert eng.requests == 0
    return res.output


def test_cli_random_default_is_32_prompts_and_concurrency_0_means_no_limit(tmp_path):
    """--help says random sends 32 prompts without --num-prompts (vLLM's flag, always >= 1); --max-concurrency 0 is
    no limit, as in vllm bench serve (no semaphore for a falsy value), recorded as null."""
    import re

    from dlmix.bench.cli import DEFAULT_RANDOM_PROMPTS
    from dlmix.cli import app

    out = CliRunner().invoke(app, ["bench", "--help"], env={"COLUMNS": "240"}).output
    help_text = " ".join(re.sub(r"\x1b\[[0-9;]*m", "", out).replace("│", " ").split())
    assert "random: default 32;" in help_text and DEFAULT_RANDOM_PROMPTS == 32
    eng = MockEngine(model="m", ttft=0.0005, itl=0.0005)
    url, stop = _serve_in_thread(eng)
    try:
        res = CliRunner().invoke(app, [
            "bench", "--url", url, "--workload", "random", "--random-input-len", "4", "--random-output-len", "1",
            "--max-concurrency", "0,2", "--output-dir", str(tmp_path)])
    finally:
        stop()
    assert res.exit_code == 0, res.output
    data = json.loads((tmp_path / "run" / "results.json").read_text())
    assert [lv["level"]["max_concurrency"] for lv in data["levels"]] == [None, 2]
    assert [lv["level"]["label"] for lv in data["levels"]] == ["rate=inf", "conc=2"]
    assert [lv["metrics"]["completed"] for lv in data["levels"]] == [32, 32]
    assert eng.requests == 64


def test_cli_takes_urls_from_a_deployment_file(tmp_path):
    from dlmix.cli import app

    eng = MockEngine(model="m", block_size=16)
    url, stop = _serve_in_thread(eng)
    port = int(url.rsplit(":", 1)[1])
    dep = tmp_path / "dep.yaml"
    dep.write_text(f"instances:\n  - {{engine: mock, port: {port}}}\n")
    try:
        res = CliRunner().invoke(app, [
            "bench", "--deployment", str(dep), "--workload", "random", "--num-prompts", "3",
            "--random-input-len", "20", "--random-output-len", "2", "--output-dir", str(tmp_path / "out")])
    finally:
        stop()
    assert res.exit_code == 0, res.output
    data = json.loads((tmp_path / "out" / "run" / "results.json").read_text())
    assert data["base_url"] == url
    lv = data["levels"][0]
    assert lv["metrics"]["completed"] == 3 and lv["metrics"]["total_input_tokens"] == 60
    assert lv["prefix"]["source"] in ("endpoint", "engines") and lv["prefix"]["query_tokens"] == 60


@pytest.mark.parametrize("args, message", [
    (["--output-dir", "{tmp}/afile"], "Invalid value for '--output-dir': cannot write results under {tmp}/afile/run: "
                                      "{tmp}/afile exists and is not a folder"),
    (["--output-dir", "{tmp}/afile/x", "--label", "a"],
     "Invalid value for '--output-dir': cannot write results under {tmp}/afile/x/a: {tmp}/afile exists and is not a folder"),
    (["--output-dir", "{tmp}/out", "--label", "../escape"],
     "Invalid value for '--label': must be a plain folder name (no '/', not '.' or '..'), got '../escape'"),
    (["--output-dir", "{tmp}/out", "--label", ""],
     "Invalid value for '--label': must be a plain folder name (no '/', not '.' or '..'), got ''"),
])
def test_cli_refuses_an_output_dir_or_label_that_cannot_hold_the_results_before_any_request(tmp_path, args, message):
    """The results are written after the whole sweep: before, ``--output-dir`` naming a file ran every request and
    then ended in a NotADirectoryError traceback (exit 1, results lost), and ``--label ../x`` wrote outside the
    output folder (which the plots, reading ``OUT/*/results.json``, never saw)."""
    from dlmix.cli import app

    (tmp_path / "afile").write_text("x")
    eng = MockEngine(model="m")
    url, stop = _serve_in_thread(eng)
    try:
        res = CliRunner().invoke(app, ["bench", "--url", url, "--workload", "random", "--num-prompts", "2",
                                       *[a.format(tmp=tmp_path) for a in args]], env={"COLUMNS": "400"})
    finally:
        stop()
    assert res.exit_code == 2, res.output
    assert isinstance(res.exception, SystemExit) and "Traceback" not in res.output
    assert _error_line(res.output) == message.format(tmp=tmp_path)
    assert eng.requests == 0
    assert not (tmp_path / "escape").exists() and not (tmp_path / "out").exists()


def test_cli_refuses_an_engine_url_that_is_not_an_http_url():
    """``--engine-url notaurl`` was accepted and silently scraped nothing after the run."""
    from dlmix.cli import app

    res = CliRunner().invoke(app, ["bench", "--url", "http://127.0.0.1:9", "--engine-url", "notaurl"],
                             env={"COLUMNS": "400"})
    assert res.exit_code == 2, res.output
    assert _error_line(res.output) == ("Invalid value for '--engine-url': must be an http(s) URL of an engine's "
                                       "root, got 'notaurl'")


def test_cli_stops_before_the_sweep_when_the_server_refuses_the_api_key(tmp_path):
    """A server that answers 401 (a dlmix router with router.config.api_keys, no --api-key given) is reported before
    any benchmark request is sent, with exit code 2 and the flag to use; not after a sweep of failed requests."""
    import http.server

    from dlmix.cli import app

    seen = {"GET": 0, "POST": 0}

    class Refuse(http.server.BaseHTTPRequestHandler):
        def _refuse(self):
            seen[self.command] += 1
            body = b'{"error": {"message": "invalid or missing API key", "type": "authentication_error"}}'
            self.send_response(401)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _refuse

        def log_message(self, *args):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Refuse)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        res = CliRunner().invoke(app, ["bench", "--url", f"http://127.0.0.1:{srv.server_address[1]}",
                                       "--gsp-num-groups", "1", "--gsp-prompts-per-group", "2",
                                       "--output-dir", str(tmp_path)])
    finally:
        srv.shutdown()
        t.join(5)
    assert res.exit_code == 2, res.output
    assert "HTTP 401" in res.output and "--api-key" in res.output
    assert seen == {"GET": 1, "POST": 0}
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("args,message", [
    (["--gsp-system-prompt-len", "0", "--gsp-question-len", "0"],
     "shared-prefix: --gsp-system-prompt-len + --gsp-question-len must be >= 1 token (a prompt), got 0"),
    (["--gsp-num-groups", "0"], "shared-prefix: --gsp-num-groups must be >= 1, got 0"),
    (["--gsp-question-len", "-4"], "shared-prefix: --gsp-question-len must be >= 0 tokens, got -4"),
])
def test_a_bad_shared_prefix_flag_is_named_by_its_flag(args, message):
    """The shared-prefix bounds name bench's own --gsp-* flags (before: 'groups >= 1, prompts per group >= 1,
    output_len >= 1, lengths >= 0 and prefix_len + suffix_len >= 1' whichever was wrong), before any request."""
    import re

    out = _refused_before_any_request(args)
    assert message in " ".join(re.sub(r"\x1b\[[0-9;]*m", "", out).split())
