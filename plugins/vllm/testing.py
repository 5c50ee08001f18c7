"""Helpers for end-to-end tests and benchmarks of DLMixConnector: start real vLLM CPU servers, run the two-step
prefill/decode client, read metrics. Used by ``tests/test_vllm_pd.py`` and ``benchmarks/pd_vllm.py``.

Servers are started as ``python -m vllm.entrypoints.openai.api_server`` subprocesses in their own process group
(so a kill reaches EngineCore and the worker), bound to 127.0.0.1, eager mode, with a 128 MiB KV cache.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import httpx

from dlmix.engine_process import free_port, pd_test_spec  # the one port helper and vLLM builder
from dlmix.testing import compare_greedy, output_logprobs  # engine-neutral; compare_greedy re-exported here

__all__ = ["free_port", "VllmServer", "launch", "wait_ready", "two_step", "single", "kv_usage", "metric_sum",
           "parse_sse", "prose", "prompt_set", "PROSE_WORDS", "compare_greedy", "n_choices_through_router"]

#: Vocabulary of :func:`prose` (40 plain English words, each one or two tokens in Llama-style tokenizers).
PROSE_WORDS = tuple(("river mountain quiet engine market yellow window garden silver theory station winter bridge "
                     "signal harvest lantern ocean pocket rhythm castle meadow copper thunder village orbit canvas "
                     "planet ribbon forest mirror candle summer compass feather island journey marble needle pebble "
                     "shadow velvet").split())


def prose(rng, n_words: int, vocabulary=PROSE_WORDS) -> str:
    """Deterministic filler text of ``n_words`` words drawn by ``rng`` (a ``random.Random``) from ``vocabulary``:
    sentences start capitalized, about one word in eight ends a sentence, and the text ends with a period."""
    out: list[str] = []
    for i in range(n_words):
        w = rng.choice(vocabulary)
        out.append(w.capitalize() if i == 0 or out[-1].endswith(".") else w)
        if rng.random() < 0.12:
            out[-1] += "."
    return " ".join(out) + "."


def prompt_set(tok, lengths, kinds=("completion", "chat", "completion"), seed: int = 1234,
               vocabulary=PROSE_WORDS) -> list[dict]:
    """Prompts for token-for-token PD tests: one per entry of ``lengths`` (tokens), the ``i``-th of kind
    ``kinds[i % len(kinds)]``: ``completion`` = exactly ``n`` token ids, ``text`` = a completion whose prompt is text
    (about ``n - 30`` tokens), ``chat`` = a user message of about ``n - 30`` tokens; odd ``i`` stream.
    ``tok`` is a Hugging Face tokenizer. Returns dicts ``{i, kind ('completion'|'chat'), prompt, stream, n}``."""
    import random

    rng = random.Random(seed)
    out = []
    for i, n in enumerate(lengths):
        text = prose(rng, n, vocabulary)
        kind = kinds[i % len(kinds)]
        if kind == "completion":
            ids = tok(text, add_special_tokens=False).input_ids
            while len(ids) < n:
                ids += tok(" " + prose(rng, 50, vocabulary), add_special_tokens=False).input_ids
            prompt = ids[:n]
        elif kind in ("chat", "text"):
            prompt = tok.decode(tok(text, add_special_tokens=False).input_ids[: max(1, n - 30)])
        else:
            raise ValueError(f"prompt kind {kind!r}: expected 'completion', 'text' or 'chat'")
        out.append({"i": i, "kind": "chat" if kind == "chat" else "completion", "prompt": prompt,
                    "stream": i % 2 == 1, "n": n})
    return out


@dataclass
class VllmServer:
    """A running vLLM OpenAI server subprocess (``url``, ``log`` path, ``proc``)."""

    name: str
    url: str
    port: int
    proc: subprocess.Popen
    log: Path
    args: list[str] = field(default_factory=list)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the whole process group (API server, EngineCore, worker) and reap it."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        self.kill(signal.SIGINT)

    def tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def launch(name: str, model: str, workdir: Path, *, role: str | None, cpu: str, block_size: int = 128,
           dtype: str = "float32", extra: dict[str, Any] | None = None, connector: str = "DLMixConnector",
           port: int | None = None, served_name: str = "smollm2", env: dict[str, str] | None = None,
           extra_args: list[str] | None = None, kv_bytes: int = 134217728) -> VllmServer:
    """Start one server (returns at once; call :meth:`wait_ready`). ``role`` None = no KV connector. ``dtype``: model
    and KV cache dtype (default fp32: bf16 matmuls are far slower on CPUs without AVX-512 BF16/AMX)."""
    port = port or free_port()
    log = workdir / f"{name}.log"
    spec = pd_test_spec(model, role=role, cpu=cpu, port=port, block_size=block_size, dtype=dtype,
                        extra=extra, connector=connector, served_name=served_name, env=env, extra_args=extra_args,
                        kv_bytes=kv_bytes)
    args, e = spec.argv(), spec.child_env()
    fh = open(log, "wb")
    proc = subprocess.Popen(args, stdout=fh, stderr=subprocess.STDOUT, env=e, start_new_session=True,
                            cwd=str(workdir))
    return VllmServer(name, f"http://127.0.0.1:{port}", port, proc, log, args)


def wait_ready(servers: list[VllmServer], timeout_s: float = 300.0) -> None:
    """Wait until every server answers ``/health`` 200. Raises RuntimeError with the log tail of a dead/slow one."""
    deadline = time.monotonic() + timeout_s
    pending = list(servers)
    while pending:
        for s in list(pending):
            if not s.alive():
                raise RuntimeError(f"vLLM server {s.name} exited with {s.proc.returncode}:\n{s.tail()}")
            try:
                if httpx.get(s.url + "/health", timeout=2).status_code == 200:
                    pending.remove(s)
            except httpx.HTTPError:
                pass
        if pending and time.monotonic() > deadline:
            raise RuntimeError(f"vLLM server {pending[0].name} not ready after {timeout_s}s:\n{pending[0].tail()}")
        if pending:
            time.sleep(1.0)


def parse_sse(text: str) -> list[dict]:
    """Events of an OpenAI SSE stream body (``data: {...}`` lines; ``[DONE]`` dropped)."""
    from dlmix.net import sse_lines

    out = []
    for line in sse_lines(text):  # not str.splitlines: outputs may hold U+2028 etc. unescaped
        if line.startswith("data: ") and line[6:].strip() != "[DONE]":
            out.append(json.loads(line[6:]))
    return out


def _post(client: httpx.Client, url: str, body: dict) -> dict:
    """POST and return the JSON response; for ``stream: true`` the events are folded into one response dict
    (``text``, ``token_ids`` if present, ``logprobs`` lists, last ``kv_transfer_params``)."""
    r = client.post(url, json=body)
    if r.status_code != 200:
        raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.text[:500]}")
    if not body.get("stream"):
        return r.json()
    events = parse_sse(r.text)
    text, ids, lps = [], [], []
    ktp = None
    for ev in events:
        if ev.get("kv_transfer_params") is not None:
            ktp = ev["kv_transfer_params"]
        for ch in ev.get("choices") or []:
            if "delta" in ch:
                text.append(ch["delta"].get("content") or "")
            else:
                text.append(ch.get("text") or "")
            if ch.get("token_ids"):
                ids += list(ch["token_ids"])
            lp = ch.get("logprobs")
            if lp:
                lps.append(lp)
    return {"stream_events": len(events), "text": "".join(text), "token_ids": ids, "logprobs_chunks": lps,
            "kv_transfer_params": ktp}


def request_body(kind: str, prompt: Any, max_tokens: int, *, stream: bool = False, logprobs: int = 2,
                 ktp: dict | None = None, extra: dict | None = None) -> tuple[str, dict]:
    """(path, body) of a greedy completion (``kind='completion'``, prompt = token ids or text) or chat request
    (``kind='chat'``, prompt = user message text), asking for generated token ids and top-``logprobs``; ``extra``:
    more body fields (e.g. ``{"ignore_eos": True}``)."""
    if kind == "chat":
        path = "/v1/chat/completions"
        body: dict[str, Any] = {"model": "smollm2", "messages": [{"role": "user", "content": prompt}],
                                "max_tokens": max_tokens, "temperature": 0, "logprobs": True,
                                "top_logprobs": logprobs}
    else:
        path = "/v1/completions"
        body = {"model": "smollm2", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "logprobs": logprobs}
    body["return_token_ids"] = True
    if stream:
        body["stream"] = True
    if ktp is not None:
        body["kv_transfer_params"] = ktp
    body.update(extra or {})
    return path, body


def result_tokens(resp: dict) -> tuple[list[int], list[float]]:
    """Generated token ids and, per position, the gap between the top-1 and top-2 logprob (inf if unknown)."""
    gaps: list[float] = []
    if "choices" in resp:
        ch = resp["choices"][0]
        ids = list(ch.get("token_ids") or [])
        chunks = [ch.get("logprobs") or {}]
    else:
        ids = list(resp.get("token_ids") or [])
        chunks = resp.get("logprobs_chunks") or []
    for lp in chunks:
        gaps += output_logprobs({"logprobs": lp})[1]
    return ids, gaps


def two_step(prefill_url: str, decode_url: str, kind: str, prompt: Any, max_tokens: int, *, stream: bool = False,
             timeout_s: float = 300.0, between=None, extra: dict | None = None) -> dict[str, Any]:
    """The PD client: prefill with ``max_tokens=1`` and ``{"do_remote_decode": true}``, then decode with the returned
    ``kv_transfer_params``. ``between(params)`` runs between the steps (e.g. kill the prefill). Returns
    ``{"prefill": resp, "decode": resp, "params": ktp, "ttft_s", "total_s"}`` (TTFT = prefill time + decode
    time-to-first-chunk for streams, else whole decode time)."""
    with httpx.Client(timeout=timeout_s) as c:
        t0 = time.perf_counter()
        path, body = request_body(kind, prompt, 1, ktp={"do_remote_decode": True}, extra=extra)
        p = _post(c, prefill_url + path, body)
        params = p.get("kv_transfer_params")
        if not params:
            raise RuntimeError(f"prefill returned no kv_transfer_params: {json.dumps(p)[:400]}")
        if between is not None:
            between(params)
        t1 = time.perf_counter()
        path, body = request_body(kind, prompt, max_tokens, stream=stream, ktp=params, extra=extra)
        d = _post(c, decode_url + path, body)
        t2 = time.perf_counter()
    return {"prefill": p, "decode": d, "params": params, "prefill_s": t1 - t0, "total_s": t2 - t0}


def single(url: str, kind: str, prompt: Any, max_tokens: int, *, stream: bool = False,
           timeout_s: float = 300.0, extra: dict | None = None) -> dict:
    """One plain request (no kv_transfer_params); ``extra``: more body fields."""
    with httpx.Client(timeout=timeout_s) as c:
        path, body = request_body(kind, prompt, max_tokens, stream=stream, extra=extra)
        return _post(c, url + path, body)


def id_prompts(n: int, seed: int, max_len: int, vocab: tuple[int, int] = (3, 250)) -> list[dict]:
    """``n`` completion prompts of random token ids in ``range(*vocab)`` (no shared prefixes), lengths spread evenly
    from 10 to ``max_len`` tokens, every second one streamed: ``[{"i", "kind", "prompt", "stream"}]``."""
    import random

    rng = random.Random(seed)
    return [{"i": i, "kind": "completion", "prompt": [rng.randrange(*vocab) for _ in range(10 + i * (max_len - 10)
                                                                                          // max(1, n - 1))],
             "stream": i % 2 == 1} for i in range(n)]


def single_references(url: str, items: list[dict], max_tokens: int, extra: dict | None = None
                      ) -> dict[int, tuple[list[int], list[float]]]:
    """The single-instance answer of the server at ``url`` to each of ``items`` (as :func:`id_prompts`), its prefix
    cache reset before and after so that nothing is a prefix hit: ``{i: (token ids, top-1/top-2 gaps)}``."""
    reset_prefix_cache(url)
    out = {p["i"]: result_tokens(single(url, p["kind"], p["prompt"], max_tokens, stream=p["stream"], extra=extra))
           for p in items}
    reset_prefix_cache(url)
    return out


def reset_prefix_cache(url: str) -> None:
    """POST /reset_prefix_cache (needs VLLM_SERVER_DEV_MODE=1, set by :func:`launch`)."""
    r = httpx.post(url + "/reset_prefix_cache", timeout=30)
    r.raise_for_status()


def kv_usage(url: str) -> float:
    """``vllm:kv_cache_usage_perc`` from the server's Prometheus ``/metrics`` (0..1, summed over engines)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    total = None
    for line in text.splitlines():
        if line.startswith("vllm:kv_cache_usage_perc"):
            total = (total or 0.0) + float(line.rsplit(" ", 1)[1])
    if total is None:
        raise RuntimeError("vllm:kv_cache_usage_perc not found in /metrics")
    return total


def metric_sum(url: str, name: str, label: str | None = None) -> float:
    """Sum of all samples of Prometheus metric ``name`` (exact sample name, e.g. ``..._total``) at ``url/metrics``,
    only those whose labels include ``label`` (e.g. ``'status="2xx"'``) when given; 0.0 when absent."""
    text = httpx.get(url + "/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if label is not None and label not in line.split(" ", 1)[0]:
            continue
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def n_choices_through_router(router_url: str, decode_url: str, body: dict, n: int = 2,
                             between: Callable[[], None] | None = None,
                             headers: dict[str, str] | None = None) -> dict[str, Any]:
    """The completion ``body`` (with ``return_token_ids``) through the dlmix router to a vLLM decode at
    ``decode_url``: once greedy with one choice, then with ``n`` choices sampled at ``top_k=1`` (the argmax; vLLM
    refuses ``n > 1`` at temperature 0), the decode's prefix cache reset before each; ``between`` runs after the
    first answer; ``headers``: sent with both requests (e.g. the router's instance pins).

    Returns ``{"one": token ids of the one-choice answer, "choices": {index: token ids}, "pulls": the decode's
    completed KV pulls during the n-choice request, "failed_pulls": its failed ones}``. Raises AssertionError on a
    non-200 answer."""
    with httpx.Client(timeout=300, headers=headers) as c:
        reset_prefix_cache(decode_url)
        one = c.post(router_url + "/v1/completions", json=dict(body, temperature=0))
        assert one.status_code == 200, one.text[:500]
        if between is not None:
            between()
        reset_prefix_cache(decode_url)
        failed0 = metric_sum(decode_url, "vllm:dlmix_kv_failed_transfers_total")
        pulls0 = metric_sum(decode_url, "vllm:dlmix_kv_transfers_total")
        r = c.post(router_url + "/v1/completions", json=dict(body, temperature=1.0, top_k=1, n=n))
        assert r.status_code == 200, r.text[:500]
    return {"one": one.json()["choices"][0]["token_ids"],
            "choices": {ch["index"]: ch["token_ids"] for ch in r.json()["choices"]},
            "pulls": metric_sum(decode_url, "vllm:dlmix_kv_transfers_total") - pulls0,
            "failed_pulls": metric_sum(decode_url, "vllm:dlmix_kv_failed_transfers_total") - failed0}


def through_router(router_url: str, decode_url: str, items: list[dict], max_tokens: int,
                   headers: dict[str, str] | None = None) -> tuple[dict, int]:
    """Send each prompt of ``items`` (:func:`prompt_set` entries) through a dlmix router whose PD decode is the vLLM
    instance at ``decode_url`` (its prefix cache reset before each, so every prompt is loaded whole from the
    prefill). Each non-streamed answer's ``kv_transfer_params.dlmix`` must report no error, no local hit, all
    prompt tokens loaded and bytes received (asserted); ``headers`` go with every request (e.g. the router's
    instance pins). Returns ``({i: greedy token ids}, number of answers
    checked so)``."""
    got, loaded = {}, 0
    reset_prefix_cache(decode_url)
    for p in items:
        path, body = request_body(p["kind"], p["prompt"], max_tokens, stream=p["stream"])
        with httpx.Client(timeout=300, headers=headers) as c:
            resp = _post(c, router_url + path, body)  # a stream folded into one answer; raises on a non-200
        got[p["i"]] = result_tokens(resp)[0]
        if not p["stream"]:
            info = resp["kv_transfer_params"]["dlmix"]
            assert info["error"] is None and info["local_hit_tokens"] == 0, info
            assert info["loaded_tokens"] == resp["usage"]["prompt_tokens"] and info["bytes_received"] > 0, info
            loaded += 1
        reset_prefix_cache(decode_url)
    return got, loaded
