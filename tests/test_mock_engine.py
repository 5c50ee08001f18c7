"""dlmix.testing.mock_engine, the one mock engine: prefix counters as vLLM counts them, and the command line with
several canned engines in one process (what benchmarks/router.py runs)."""
from __future__ import annotations

import subprocess
import sys

import httpx

from dlmix.testing import LoopThread, free_port
from dlmix.testing.mock_engine import MockEngine


def test_prefix_counters_and_metrics_text():
    lt = LoopThread()
    e = MockEngine(model="m", block_size=4)
    try:
        url = lt.run(e.start())
        body = {"model": "m", "prompt": list(range(10)), "max_tokens": 2}
        assert httpx.post(url + "/v1/completions", json=body).status_code == 200
        r = httpx.post(url + "/v1/completions", json=dict(body, prompt=list(range(9)) + [99]))
        assert r.json()["usage"] == {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12}
        assert (e.hits, e.queries) == (8, 20)  # 2 full blocks of 4 seen before, 10 + 10 tokens queried
        text = httpx.get(url + "/metrics").text
        assert 'vllm:prefix_cache_hits_total{model_name="m"} 8' in text
        assert 'vllm:request_success_total{model_name="m"} 2' in text
        assert e.bodies[1]["prompt"][-1] == 99
    finally:
        lt.run(e.stop())
        lt.close()


def test_command_line_runs_several_canned_engines():
    ports = [free_port(), free_port()]
    p = subprocess.Popen([sys.executable, "-m", "dlmix.testing.mock_engine", "--canned", "--ports",
                          ",".join(map(str, ports))], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().startswith("mock engine pid")
        for port in ports:
            assert p.stdout.readline().strip() == f"mock engine listening on http://127.0.0.1:{port}"
        with httpx.Client(timeout=10) as h:
            r = h.post(f"http://127.0.0.1:{ports[1]}/v1/completions", json={"prompt": "x", "stream": False})
            assert r.json()["choices"][0]["text"] == " a b c d e f g h"
            s = h.post(f"http://127.0.0.1:{ports[1]}/v1/completions", json={"prompt": "x", "stream": True})
            assert s.text.count("data: ") == 9 and s.text.endswith("data: [DONE]\n\n")
            assert h.get(f"http://127.0.0.1:{ports[1]}/mock/stats").json() == {"requests": 2}
            assert h.get(f"http://127.0.0.1:{ports[0]}/mock/stats").json() == {"requests": 0}
    finally:
        p.terminate()
        assert p.wait(10) == 0


def test_max_tokens_beyond_the_context_is_400_not_a_frozen_engine():
    """Review 4: ``max_tokens: 99999999999999999999999`` made the mock build that many words: the process (every
    engine of a ``--ports`` process) stopped answering, health checks included, and grew by GBs; vLLM answers 400."""
    lt = LoopThread()
    e = MockEngine(model="m")
    try:
        url = lt.run(e.start())
        r = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 10 ** 23},
                       timeout=10)
        assert r.status_code == 400 and "max_tokens must be at most" in r.text, r.text
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        assert httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 30_000},
                          timeout=30).status_code == 200
    finally:
        lt.run(e.stop())
        lt.close()
