"""``dlmix demo``: the README's main job, on the real SmolLM2 model.

It launches two CPU PD deployments in turn, the dlmix router in front of each: ``examples/cpu-pd.yaml`` (vLLM
prefill in bf16 with KV block size 32 on core 0, vLLM decode in fp32 with block size 128 on core 1), then
``examples/cpu-lmdeploy-prefill-vllm-decode.yaml`` (PD across engines: an LMDeploy prefill in bf16 with block size 16
and its packed cache pool feeds the same vLLM decode; skipped with the reason when LMDeploy's venv is absent). For
each it sends a handful of real requests
through the router (single questions, a multi-turn chat sharing a long system prompt, streamed and not), prints the
answers as they stream, and ends with one table row per request:

    prefill instance, decode instance, path (disaggregated or local), prompt tokens, prefix-hit tokens,
    KV bytes moved, KV transfer time, TTFT, TPOT.

Everything in the table is measured, nothing assumed: requests go one at a time, and each row comes from the
difference of Prometheus counters before and after the request (the router's ``dlmix_router_requests_total``
by route, ``dlmix_router_prefill_responses_total`` and ``dlmix_router_responses_total`` by instance; the vLLM
engines' ``vllm:prefix_cache_hits_total``; the
decode instance's ``vllm:dlmix_kv_bytes_received_total`` and ``vllm:dlmix_kv_transfer_seconds_sum``, published by
DLMixConnector), plus client-side timing of the stream (TTFT, TPOT = (E2E − TTFT) / (output tokens − 1)).

Then each answer is checked against a single instance: the same request is sent straight to the decode instance
(greedy, with a fresh ``cache_salt`` so none of the KV it received from the prefill instance is reused; vLLM keys its
prefix cache by the salt) and the two answers are compared. A difference is a near-tie when the single instance's
top-1 and top-2 logprobs at the first differing token are closer than ``NEAR_TIE_NATS`` (the bf16 prefill's KV is
rounded where the fp32 decode's own prefill is not, so a token that wins by less than that may flip); any other
difference means the decode read KV it should not have, and fails the demo.

Exit code 0 only if every request succeeded, the decode instance really received KV, and every answer equals the
single instance's or differs at a near-tie.
"""
from __future__ import annotations

import json
import secrets
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import httpx

from dlmix.net import iter_sse_lines
from dlmix.paths import file_problem
from dlmix.testing import output_logprobs

__all__ = ["run_demo", "DEFAULT_DEPLOYMENT", "DEFAULT_DEPLOYMENTS", "DemoRow", "scrape", "first_divergence",
           "NEAR_TIE_NATS"]

#: A first differing token whose top-1/top-2 logprob gap on the single instance is below this (nats) is a near-tie,
#: not a wrong answer: the threshold the bf16 prefill -> fp32 decode end-to-end test uses (tests/test_vllm_pd.py).
NEAR_TIE_NATS = 0.5

DEFAULT_DEPLOYMENT = Path(__file__).resolve().parents[1] / "examples" / "cpu-pd.yaml"
#: what ``dlmix demo`` runs: PD across block size and dtype on vLLM, then PD across engines (an LMDeploy prefill
#: feeding a vLLM decode; skipped with the reason when the LMDeploy venv is absent)
DEFAULT_DEPLOYMENTS = (DEFAULT_DEPLOYMENT, DEFAULT_DEPLOYMENT.parent / "cpu-lmdeploy-prefill-vllm-decode.yaml")

SYSTEM_PROMPT = (
    "You are the help desk assistant of Northwind Rail, a regional railway company. Answer briefly and politely. "
    "Facts you may use: trains run every 30 minutes from 6 am to midnight on weekdays and every hour on weekends. "
    "Tickets can be bought at stations, in the app, or on board with a surcharge of two euros. Children under six "
    "travel free; children from six to fourteen pay half price. Bicycles are allowed outside rush hours (7-9 am and "
    "4-7 pm) at a cost of three euros per trip. Lost property is kept for 30 days at the central station. Pets in a "
    "carrier travel free; larger dogs need a child ticket and must be on a leash. The quiet coach is always the first "
    "coach of the train. Delays of more than 60 minutes are refunded at 25 percent, more than 120 minutes at 50 "
    "percent, claimed within 14 days in the app. Season tickets are personal and must be shown with an ID card. "
    "Wheelchair users can book assistance 24 hours before travel by phone; staff meet them at the platform. "
    "Smoking and vaping are forbidden on trains and platforms. Food and drinks are allowed except in the quiet coach. "
    "The first-class upgrade costs eight euros and can be bought on board when seats are free. Group tickets for "
    "ten or more people get a 20 percent discount if booked a week ahead. Station lockers cost four euros per day. "
    "Never invent facts that are not listed here; if you do not know, say so and give the phone number 0800 1234."
)


@dataclass
class DemoRequest:
    """One request of the demo: OpenAI endpoint path, body, and whether to stream it."""

    label: str
    path: str
    body: dict
    stream: bool = True


@dataclass
class DemoRow:
    """Measured figures of one request (bytes, seconds, tokens); ``None`` where not measurable."""

    label: str
    deployment: str = ""
    ok: bool = False
    error: str = ""
    text: str = ""
    prefill: str = "-"
    decode: str = "-"
    path: str = "-"
    prompt_tokens: Optional[int] = None
    output_tokens: Optional[int] = None
    hit_tokens: Optional[int] = None
    kv_bytes: int = 0
    transfer_s: float = 0.0
    ttft_s: Optional[float] = None
    tpot_s: Optional[float] = None
    e2e_s: Optional[float] = None
    #: against a single instance: "same", "near-tie@K" (first difference at output token K, a near-tie),
    #: "DIFFERS@K" (a wrong answer), or "-" (not checked) / "error: ..." (the reference request failed)
    single: str = "-"
    extra: Dict[str, float] = field(default_factory=dict)


def scrape(url: str, timeout: float = 10.0) -> Dict[tuple, float]:
    """Read a Prometheus ``/metrics`` page into ``{(sample name, frozenset(labels.items())): value}``.

    Raises:
        httpx.HTTPError: the endpoint is unreachable.
    """
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url.rstrip("/") + "/metrics", timeout=timeout).text
    out: Dict[tuple, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def _delta(after: Dict[tuple, float], before: Dict[tuple, float], name: str, **match) -> Dict[frozenset, float]:
    """Per-label-set increase of sample ``name`` whose labels include ``match``."""
    res: Dict[frozenset, float] = {}
    for (n, labels), v in after.items():
        if n != name or any(dict(labels).get(k) != val for k, val in match.items()):
            continue
        d = v - before.get((n, labels), 0.0)
        if d:
            res[labels] = d
    return res


def _sum(d: Dict[frozenset, float]) -> float:
    return float(sum(d.values()))


def demo_requests(model: str, max_tokens: int) -> List[DemoRequest]:
    """The demo's requests: two single questions, a three-turn chat and a second user sharing the long system
    prompt (their later turns hit the prefix cache), a plain completion (not streamed)."""
    sys_msg = {"role": "system", "content": SYSTEM_PROMPT}
    chat = lambda msgs, stream=True: {"model": model, "messages": msgs, "max_tokens": max_tokens,  # noqa: E731
                                      "temperature": 0, "stream": stream,
                                      **({"stream_options": {"include_usage": True}} if stream else {})}
    return [
        DemoRequest("question 1", "/v1/chat/completions",
                    chat([{"role": "user", "content": "What is the capital of France?"}])),
        DemoRequest("question 2", "/v1/chat/completions", chat([{"role": "user", "content": "Name three colors."}])),
        DemoRequest("chat turn 1", "/v1/chat/completions",
                    chat([sys_msg, {"role": "user", "content": "Can I take my bicycle on the train at 8 am?"}])),
        DemoRequest("chat turn 2", "/v1/chat/completions", chat([]), stream=True),  # messages filled in at run time
        DemoRequest("other user, same system prompt", "/v1/chat/completions",
                    chat([sys_msg, {"role": "user", "content": "How much does a station locker cost?"}])),
        DemoRequest("completion (not streamed)", "/v1/completions",
                    {"model": model, "prompt": "The three primary colors are", "max_tokens": max_tokens,
                     "temperature": 0}, stream=False),
    ]


def _send(client: httpx.Client, base: str, req: DemoRequest, row: DemoRow, echo) -> None:
    """Send one request; fill text, token counts and client-side timing into ``row``."""
    t0 = time.perf_counter()
    if not req.stream:
        r = client.post(base + req.path, json=req.body)
        row.e2e_s = time.perf_counter() - t0
        if r.status_code != 200:
            row.error = f"HTTP {r.status_code}: {r.text[:300]}"
            return
        data = r.json()
        c = data["choices"][0]
        row.text = c.get("text") if "text" in c else c["message"]["content"]
        echo(row.text)
        usage = data.get("usage") or {}
        row.prompt_tokens, row.output_tokens = usage.get("prompt_tokens"), usage.get("completion_tokens")
        row.ok = bool(row.text.strip())
        return
    first: Optional[float] = None
    parts: List[str] = []
    usage: dict = {}
    with client.stream("POST", base + req.path, json=req.body) as r:
        if r.status_code != 200:
            row.error = f"HTTP {r.status_code}: {r.read().decode(errors='replace')[:300]}"
            return
        for line in iter_sse_lines(r):
            if not line.startswith("data: ") or line.strip() == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk.get("choices") or []:
                piece = (c.get("delta") or {}).get("content") or c.get("text") or ""
                if piece:
                    if first is None:
                        first = time.perf_counter()
                    parts.append(piece)
                    echo(piece)
    end = time.perf_counter()
    row.text = "".join(parts)
    row.e2e_s = end - t0
    row.ttft_s = (first - t0) if first is not None else None
    row.prompt_tokens, row.output_tokens = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if row.ttft_s is not None and row.output_tokens and row.output_tokens > 1:
        row.tpot_s = (row.e2e_s - row.ttft_s) / (row.output_tokens - 1)
    row.ok = bool(row.text.strip())


def _measure(row: DemoRow, roles: Dict[str, str], before: dict, after: dict) -> None:
    """Fill placement, prefix hits and KV transfer figures of ``row`` from metric differences.

    The instances that served the request are those the router counted a successful answer from: its
    ``dlmix_router_prefill_responses_total`` (the one-token prefill leg of a disaggregated request) and
    ``dlmix_router_responses_total`` (the decode leg, or the whole request) by instance, whatever their engine.
    Prefix hits and KV bytes come from the vLLM instances' own counters (absent for other engines: ``-``).
    """
    r0, r1 = before["router"], after["router"]
    routes = _delta(r1, r0, "dlmix_router_requests_total")
    row.extra["route"] = ",".join(sorted(dict(k).get("route", "?") for k in routes)) or "?"  # type: ignore
    served = lambda name: [dict(k).get("instance") for k in _delta(r1, r0, name, status="2xx")]  # noqa: E731
    pre = [n for n in served("dlmix_router_prefill_responses_total") if n in roles]
    dec = [n for n in served("dlmix_router_responses_total") if n in roles]
    row.decode = dec[0] if dec else "-"
    row.prefill = pre[0] if pre else row.decode
    row.path = "disaggregated" if pre else "local"
    hits = lambda n: int(_sum(_delta(after[n], before[n], "vllm:prefix_cache_hits_total")))  # noqa: E731
    if row.prefill in after:
        row.hit_tokens = hits(row.prefill)
    if row.decode in after:
        d = row.decode
        row.extra["decode_hit_tokens"] = hits(d) if pre else 0  # type: ignore[assignment]
        row.kv_bytes = int(_sum(_delta(after[d], before[d], "vllm:dlmix_kv_bytes_received_total")))
        row.transfer_s = _sum(_delta(after[d], before[d], "vllm:dlmix_kv_transfer_seconds_sum"))


def first_divergence(text: str, tokens: List[str]) -> Optional[int]:
    """Index of the first of ``tokens`` (the single instance's output, one string per token) at which ``text`` (the
    answer under test) stops agreeing with them, or None when ``text`` equals their concatenation."""
    if text == "".join(tokens):
        return None
    acc = ""
    for k, tok in enumerate(tokens):
        acc += tok
        if not text.startswith(acc):
            return k
    return len(tokens)  # text goes on past the single instance's answer: it differs right after it


def _check_single(client: httpx.Client, url: str, req: DemoRequest, row: DemoRow) -> None:
    """Send ``req`` straight to the instance at ``url`` (not streamed, a fresh ``cache_salt``, top-2 logprobs) and set
    ``row.single`` by comparing its answer with ``row.text`` (see the module docstring)."""
    body = dict(req.body, stream=False, cache_salt=f"dlmix-demo-{secrets.token_hex(8)}")
    body.pop("stream_options", None)
    if req.path.endswith("/chat/completions"):
        body.update(logprobs=True, top_logprobs=2)
    else:
        body["logprobs"] = 2
    try:
        r = client.post(url + req.path, json=body)
    except httpx.HTTPError as e:
        row.single = f"error: {type(e).__name__}: {e}"
        return
    if r.status_code != 200:
        row.single = f"error: HTTP {r.status_code}: {r.text[:200]}"
        return
    data = r.json()
    ch = data["choices"][0]
    ref_text = ch["text"] if "text" in ch else (ch.get("message") or {}).get("content")
    if row.text == ref_text:  # the answer text, special tokens (e.g. the end-of-turn token) left out, as streamed
        row.single = "same"
        return
    toks, gaps = output_logprobs(ch)
    k = first_divergence(row.text, toks)
    if k is None:
        row.single = "same"
        return
    gap = gaps[k] if k < len(gaps) else float("inf")
    row.single = f"{'near-tie' if gap < NEAR_TIE_NATS else 'DIFFERS'}@{k}"
    row.extra["single_gap_nats"] = round(gap, 4)


def _table(rows: List[DemoRow], name: str = ""):
    from rich.table import Table

    t = Table(title=f"dlmix demo{' ' + name if name else ''}: one row per request (measured)")
    for col in ("request", "prefill", "decode", "path", "prompt tok", "prefix hit P/D", "KV bytes moved",
                "transfer ms", "TTFT ms", "TPOT ms", "single instance", "ok"):
        t.add_column(col, justify="left" if col in ("request", "prefill", "decode", "path") else "right")
    ms = lambda s: "-" if s is None else f"{s * 1000:.0f}"  # noqa: E731
    for r in rows:
        t.add_row(r.label, r.prefill, r.decode, r.path, str(r.prompt_tokens if r.prompt_tokens is not None else "-"),
                  f"{r.hit_tokens if r.hit_tokens is not None else '-'}/{r.extra.get('decode_hit_tokens', '-')}",
                  f"{r.kv_bytes:,}",
                  f"{r.transfer_s * 1000:.1f}", ms(r.ttft_s), ms(r.tpot_s), r.single, "yes" if r.ok else "NO")
    return t


def run_demo(deployment: str | Path | List[str | Path] | None = None, max_tokens: int = 48,
             free_ports: bool = False, json_out: Optional[str] = None) -> int:
    """Launch each deployment in turn (default :data:`DEFAULT_DEPLOYMENTS`: vLLM PD across block size and dtype,
    then an LMDeploy prefill feeding a vLLM decode), run the demo requests, print the table per deployment.

    Args:
        deployment: one deployment file or a list (see ``dlmix launch``); each needs a router and a decode instance.
        max_tokens: output tokens per request.
        free_ports: replace every port of the file by a free one (for tests and busy machines).
        json_out: also write the rows as JSON to this file (each row names its ``deployment``).

    Returns:
        0 when, in every deployment, every request succeeded, the decode side received KV bytes (measured) and every
        answer equals a single instance's up to near-ties, else 1; 2 for a bad file or a ``json_out`` that cannot be
        written (refused before anything starts).
    """
    from rich.console import Console

    console = Console(width=None if sys.stdout.isatty() else 150)
    if deployment is None:
        paths = []
        for p in DEFAULT_DEPLOYMENTS:
            missing = _missing_python(p)
            if missing:
                console.print(f"[yellow]demo: skipping {p.name}: {missing}")
            else:
                paths.append(p)
    else:
        paths = [Path(d) for d in (deployment if isinstance(deployment, (list, tuple)) else [deployment])]
    problem = file_problem(json_out) if json_out else None
    if problem:  # written after every deployment ran: refused before the first starts
        console.print(f"[red]demo: --json {json_out}: {problem}[/]", highlight=False, soft_wrap=True)
        return 2
    rc, rows = 0, []
    from dlmix.launch.cli import stopping_on_signals

    # SIGTERM/SIGHUP (kill, a CI timeout) stop the deployment as Ctrl-C does, and a second signal does not cut that
    # stop short: the same handling as `dlmix launch`
    with stopping_on_signals():
        for path in paths:
            r, part = _run_one(console, path, max_tokens, free_ports)
            rows += part
            rc = max(rc, r)
            if r == 2:
                break
    if json_out:
        Path(json_out).write_text(json.dumps([r.__dict__ for r in rows], indent=1, default=str))
    return rc


def _missing_python(path: Path) -> str:
    """Why a default deployment cannot run here (an instance's ``python`` is absent), or ``""``."""
    from dlmix.launch import ConfigError, Deployment

    try:
        dep = Deployment.from_file(path)
    except (ConfigError, OSError) as e:
        return str(e)
    for inst in dep.instances:
        if inst.python and not Path(_resolve_python(inst.python, path)).exists():
            return (f"instance {inst.name!r} runs {inst.python}, which does not exist (scripts/setup.sh builds it "
                    "unless DLMIX_WITH_LMDEPLOY=0)")
    return ""


def _resolve_python(python: str, path: Path) -> str:
    """A relative ``python`` of a bundled example is relative to the project root (where scripts/setup.sh builds
    the engines' venvs), not to where ``dlmix demo`` runs."""
    p = Path(python)
    if p.is_absolute() or p.exists() or path.resolve().parent != DEFAULT_DEPLOYMENT.parent:
        return python
    return str(DEFAULT_DEPLOYMENT.parents[1] / p)


def _run_one(console, path: Path, max_tokens: int, free_ports: bool) -> tuple:
    """Launch one deployment, run the demo requests, print its table. Returns (exit code, rows)."""
    from dlmix.engine_process import free_port_block
    from dlmix.launch import ConfigError, Deployment, LaunchError, launch
    from dlmix.models import ModelError

    console.print(f"\n[bold]== {path.name} ==[/]")
    try:
        dep = Deployment.from_file(path)
    except (ConfigError, OSError) as e:
        console.print(f"[red]demo: cannot use {path}: {e}")
        return 2, []
    for inst in dep.instances:
        if inst.python:
            inst.python = _resolve_python(inst.python, path)
    if free_ports:  # below the ephemeral range: engines starting meanwhile cannot take them (free_port_block)
        taken: set = set()
        for obj in [dep.router, *dep.instances]:
            obj.port = free_port_block(1, "127.0.0.1", taken)  # type: ignore[union-attr]
            taken.add(obj.port)
    if not dep.router_enabled():
        console.print(f"[red]demo: {path} has no router")
        return 2, []
    rows: List[DemoRow] = []
    try:
        with launch(dep, console=console) as running:
            base = running.router_url
            model = running.instances[0].served_model_name
            roles = {i.name: i.role for i in running.instances}
            urls = {i.name: i.url for i in running.instances}
            engines = {i.name: i.engine for i in running.instances}
            # vLLM instances publish the connector's counters; other engines are seen through the router's
            metric_urls = {n: u for n, u in urls.items() if engines[n] in ("vllm", "mock")}
            console.print(f"\n[bold]Router at {base}[/]; instances: "
                          + ", ".join(f"{i.name} ({i.role}, {i.url})" for i in running.instances))
            reqs = demo_requests(model, max_tokens)
            history: List[dict] = []
            with httpx.Client(timeout=httpx.Timeout(600.0, connect=10.0)) as client:
                for req in reqs:
                    if req.label == "chat turn 1":
                        history = list(req.body["messages"])
                    if req.label == "chat turn 2":
                        req.body["messages"] = history + [
                            {"role": "user", "content": "And how much does that cost for one trip?"}]
                    console.print(f"\n[bold cyan]{req.label}[/] → ", end="")
                    last = req.body.get("messages", [{}])[-1].get("content") if "messages" in req.body else \
                        req.body["prompt"]
                    console.print(f"[dim]{last}[/]")
                    before = {"router": scrape(base), **{n: scrape(u) for n, u in metric_urls.items()}}
                    row = DemoRow(req.label, deployment=path.stem)
                    try:
                        _send(client, base, req, row, lambda s: (sys.stdout.write(s), sys.stdout.flush()))
                    except httpx.HTTPError as e:
                        row.error = f"{type(e).__name__}: {e}"
                    print()
                    if req.label == "chat turn 1" and row.ok:
                        history.append({"role": "assistant", "content": row.text})
                    # engine stats reach Prometheus on the engine's next step: poll briefly for them to settle
                    after = {}
                    for _ in range(20):
                        after = {"router": scrape(base), **{n: scrape(u) for n, u in metric_urls.items()}}
                        _measure(row, roles, before, after)
                        if row.decode != "-" and (row.path != "disaggregated" or row.kv_bytes > 0):
                            break
                        time.sleep(0.25)
                    if row.error:
                        console.print(f"[red]{row.error}")
                    rows.append(row)
                # after all rows are measured (a reference request must not show in a row's counter differences)
                console.print("\n[bold]Checking every answer against a single instance[/] (the decode instance "
                              "alone, greedy, own prefill: a fresh cache_salt)")
                for req, row in zip(reqs, rows):
                    if row.ok and row.decode in metric_urls:
                        _check_single(client, urls[row.decode], req, row)
    except (LaunchError, ModelError) as e:
        console.print(f"[red]demo: deployment failed: {e}")
        return 1, rows
    console.print(_table(rows, path.stem))
    total_kv = sum(r.kv_bytes for r in rows)
    wrong = [r.label for r in rows if r.single.startswith(("DIFFERS", "error"))]
    ties = [r.label for r in rows if r.single.startswith("near-tie")]
    ok = all(r.ok for r in rows) and total_kv > 0 and not wrong
    if ok:
        console.print(f"[green]demo ok: {len(rows)} requests succeeded; the decode instance received "
                      f"{total_kv:,} bytes of KV from the prefill instance; answers equal to a single instance: "
                      f"{len(rows) - len(ties)}, near-ties (top-2 gap < {NEAR_TIE_NATS} nats): {len(ties)}")
        return 0, rows
    failed = [r.label for r in rows if not r.ok]
    console.print(f"[red]demo failed: unsuccessful requests {failed}; answers that differ from a single instance "
                  f"(not a near-tie) or could not be checked: {wrong}; KV bytes received by decode: {total_kv}")
    return 1, rows
