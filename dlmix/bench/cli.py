"""``dlmix bench``: command-line front end of :mod:`dlmix.bench` (registered in :mod:`dlmix.cli`)."""
from __future__ import annotations

import asyncio
import json
import math
import time
from pathlib import Path
from typing import List, Optional
from urllib.parse import urlsplit

import typer

from dlmix.bench.workloads import WorkloadError
from dlmix.workloads import check_shared_prefix
from dlmix.paths import folder_problem

__all__ = ["bench", "DEFAULT_RANDOM_PROMPTS"]

#: prompts of ``--workload random`` without ``--num-prompts``
DEFAULT_RANDOM_PROMPTS = 32


def _numbers(text: str) -> list[tuple[str, float]]:
    """``(token, value)`` of a comma list of numbers (``inf`` allowed). Raises typer.BadParameter."""
    out = []
    for t in text.replace(" ", "").split(","):
        if not t:
            continue
        try:
            out.append((t, math.inf if t.lower() in ("inf", "infinity") else float(t)))
        except ValueError:
            raise typer.BadParameter(f"{t!r} is not a number") from None
    return out


# Parse-time checks (click callbacks: a bad value is "Invalid value for '--flag': ...", exit 2, before any request).
# Ranges as in ``vllm bench serve`` (vllm/benchmarks/serve.py): rate > 0 (inf = all at once), burstiness > 0,
# max concurrency None = no limit and 0 also none (vLLM creates no semaphore for a falsy value), prompts >= 1.

def _request_rates(value: str) -> list[Optional[float]]:
    if value.strip().lower() == "trace":
        return [None]
    if "trace" in [t.strip().lower() for t in value.split(",")]:
        raise typer.BadParameter("'trace' (the trace's own timestamps) must be given alone, not in a list")
    rates = _numbers(value)
    if not rates:
        raise typer.BadParameter("needs at least one value")
    for tok, v in rates:
        if not v > 0:
            raise typer.BadParameter(f"must be > 0 or inf, got {tok}")
    return [v for _, v in rates]


def _max_concurrencies(value: Optional[str]) -> list[Optional[int]]:
    if value is None:
        return [None]
    out: list[Optional[int]] = []
    for tok in value.replace(" ", "").split(","):
        if not tok:
            continue
        try:
            n = int(tok)
        except ValueError:
            raise typer.BadParameter(f"must be an integer >= 0, got {tok!r}") from None
        if n < 0:
            raise typer.BadParameter(f"must be >= 0 (0 = no limit), got {n}")
        out.append(n or None)
    if not out:
        raise typer.BadParameter("needs at least one value")
    return out


def _positive(value: float) -> float:
    if not value > 0:
        raise typer.BadParameter(f"must be > 0, got {value:g}")
    return value


def _percentiles(value: str) -> list[float]:
    out = _numbers(value)
    for tok, v in out:
        if not 0 <= v <= 100:
            raise typer.BadParameter(f"must be in [0, 100], got {tok}")
    return [v for _, v in out]


def _num_prompts(value: Optional[int]) -> Optional[int]:
    if value is not None and value < 1:
        raise typer.BadParameter(f"must be >= 1, got {value}")
    return value


def bench(
    base_url: str = typer.Option("http://127.0.0.1:8000", "--base-url", "--url",
                                 help="OpenAI server root: a dlmix router or one engine"),
    deployment: Optional[Path] = typer.Option(None, "--deployment",
                                              help="dlmix launch YAML: take the router URL and engine URLs from it"),
    model: Optional[str] = typer.Option(None, "--model", help="model name (default: first of /v1/models)"),
    endpoint: str = typer.Option("/v1/completions", "--endpoint"),
    workload: str = typer.Option("shared-prefix", "--workload", "--dataset-name",
                                 help="shared-prefix | random | mooncake"),
    num_prompts: Optional[int] = typer.Option(
        None, "--num-prompts", callback=_num_prompts, show_default=False,
        help="prompts, >= 1. random: default 32; mooncake: the trace's first N (default: all); shared-prefix: "
             "not used (--gsp-*)"),
    random_input_len: int = typer.Option(128, "--random-input-len"),
    random_output_len: int = typer.Option(16, "--random-output-len"),
    gsp_num_groups: int = typer.Option(4, "--gsp-num-groups"),
    gsp_prompts_per_group: int = typer.Option(4, "--gsp-prompts-per-group"),
    gsp_system_prompt_len: int = typer.Option(256, "--gsp-system-prompt-len", help="shared prefix tokens"),
    gsp_question_len: int = typer.Option(32, "--gsp-question-len", help="unique suffix tokens"),
    gsp_output_len: int = typer.Option(16, "--gsp-output-len"),
    trace: Optional[str] = typer.Option(None, "--trace",
                                       help="Mooncake trace (JSON lines, .gz ok) or mooncake-conversation (built in)"),
    trace_block_tokens: int = typer.Option(512, "--trace-block-tokens",
                                           help="tokens per hash id (512 = as recorded; smaller scales down)"),
    trace_time_scale: float = typer.Option(1.0, "--trace-time-scale", min=0.0, help="multiply trace timestamps"),
    max_input_len: int = typer.Option(0, "--max-input-len", min=0,
                                      help="cut prompts to this many tokens (0 = no cut)"),
    max_output_len: int = typer.Option(0, "--max-output-len", min=0,
                                       help="cut outputs to this many tokens (0 = no cut)"),
    request_rate: str = typer.Option("inf", "--request-rate", callback=_request_rates,
                                     help="req/s > 0; comma list for a sweep (inf = all at once; 'trace' = "
                                          "timestamps)"),
    max_concurrency: Optional[str] = typer.Option(None, "--max-concurrency", callback=_max_concurrencies,
                                                  show_default=False,
                                                  help="cap in-flight requests, integer >= 1 (default and 0: no "
                                                       "limit, as vllm bench serve); comma list sweeps"),
    burstiness: float = typer.Option(1.0, "--burstiness", callback=_positive,
                                     help="Gamma shape of arrivals, > 0 (1 = Poisson; inf = constant gaps)"),
    seed: int = typer.Option(0, "--seed", min=0),
    goodput: List[str] = typer.Option([], "--goodput", help="SLOs in ms, e.g. --goodput ttft:500 --goodput tpot:50"),
    metric_percentiles: str = typer.Option("50,90,99", "--metric-percentiles", callback=_percentiles,
                                           help="reported percentiles, each in [0, 100]"),
    engine_url: List[str] = typer.Option([], "--engine-url", help="engine roots to scrape for prefix-cache counters"),
    output_dir: Path = typer.Option(Path("bench-results"), "--output-dir"),
    label: str = typer.Option("run", "--label", help="run name (sub-folder; plots compare all labels in the dir)"),
    token_range: str = typer.Option("10:256", "--token-range", help="prompt token ids drawn from [LO, HI)"),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="DLMIX_API_KEY"),
    ignore_eos: bool = typer.Option(True, "--ignore-eos/--no-ignore-eos"),
    timeout: float = typer.Option(600.0, "--timeout", callback=_positive, help="per-request timeout, seconds"),
) -> None:
    """Load-test an OpenAI endpoint: request-rate or concurrency sweeps; TTFT/TPOT/ITL/E2EL, throughput, goodput
    and prefix-hit rate as a table, results.json and PNG plots (metric definitions of `vllm bench serve`)."""
    from rich.console import Console

    from dlmix.bench import report, workloads
    from dlmix.bench.runner import BenchSettings, Level, run_sweep
    from dlmix.bench.stats import parse_goodput

    console = Console()
    try:
        slo = parse_goodput(goodput)
        pcts: list = metric_percentiles  # parsed and checked by its callback
    except (ValueError, TypeError) as e:
        raise typer.BadParameter(str(e)) from None
    try:
        lo, hi = (int(x) for x in token_range.split(":"))
    except ValueError:
        raise typer.BadParameter(f"expected LO:HI (two integers), got {token_range!r}",
                                 param_hint="'--token-range'") from None
    # the results are written after the whole sweep: a label or folder that cannot hold them is refused now, not
    # after hours of requests (a label is one folder name: plots and summary.json read OUT/*/results.json)
    if label in ("", ".", "..") or "/" in label or "\\" in label:
        raise typer.BadParameter(f"must be a plain folder name (no '/', not '.' or '..'), got {label!r}",
                                 param_hint="'--label'")
    problem = folder_problem(Path(output_dir) / label)
    if problem:
        raise typer.BadParameter(f"cannot write results under {Path(output_dir) / label}: {problem}",
                                 param_hint="'--output-dir'")
    engines = list(engine_url)
    for u in engines:  # scraped only after the run: a typo would silently give no prefix-cache counters
        parts = urlsplit(u)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise typer.BadParameter(f"must be an http(s) URL of an engine's root, got {u!r}",
                                     param_hint="'--engine-url'")
    if deployment is not None:
        from dlmix.launch.config import ConfigError, Deployment

        try:
            dep = Deployment.from_file(deployment)
        except ConfigError as e:
            console.print(f"[red]error:[/] {e}")
            raise typer.Exit(2)
        base_url = dep.entry_url()
        # with PD, prompts are computed (and cache-hit) on the prefill instances; decode instances receive the KV
        # and would dilute the rate, so only prefill-capable instances are scraped when prefill instances exist
        pd = any(i.role == "prefill" for i in dep.instances)
        engines = engines or [i.url for i in dep.instances if not pd or i.role in ("prefill", "both")]
    if engines == [base_url]:
        engines = []

    rates: list = request_rate  # parsed and checked by the callbacks
    if rates == [None] and workload != "mooncake":
        raise typer.BadParameter(f"'trace' replays the timestamps of a trace: only with --workload mooncake, not "
                                 f"{workload!r}", param_hint="'--request-rate'")
    concs: list = max_concurrency
    if len(rates) > 1 and len(concs) > 1:
        raise typer.BadParameter("sweep either --request-rate or --max-concurrency, not both")
    levels = ([Level(r, concs[0]) for r in rates] if len(rates) >= len(concs)
              else [Level(rates[0], c) for c in concs])

    block_for_reuse = 16
    try:
        if workload == "shared-prefix":
            if num_prompts is not None:
                raise typer.BadParameter("not used by shared-prefix; see --gsp-*", param_hint="'--num-prompts'")

            check_shared_prefix(gsp_num_groups, gsp_prompts_per_group, gsp_system_prompt_len, gsp_question_len,
                                gsp_output_len, names=("--gsp-num-groups", "--gsp-prompts-per-group",
                                                       "--gsp-system-prompt-len", "--gsp-question-len",
                                                       "--gsp-output-len"))

            def make(s: int):
                return workloads.shared_prefix(gsp_num_groups, gsp_prompts_per_group, gsp_system_prompt_len,
                                               gsp_question_len, gsp_output_len, seed=s, token_lo=lo, token_hi=hi)
        elif workload == "random":
            def make(s: int):
                return workloads.random_prompts(num_prompts or DEFAULT_RANDOM_PROMPTS, random_input_len,
                                                random_output_len, seed=s,
                                                token_lo=lo, token_hi=hi)
        elif workload == "mooncake":
            if trace is None:
                raise typer.BadParameter("--workload mooncake needs --trace FILE")
            reqs = workloads.load_mooncake_trace(trace, trace_block_tokens, seed, num_prompts,
                                                 trace_time_scale, max_input_len or None, max_output_len or None,
                                                 lo, hi)

            def make(s: int):
                return reqs
        else:
            raise typer.BadParameter(f"unknown --workload {workload!r} (shared-prefix, random, mooncake)")
        make(seed)  # validate parameters before any request is sent
    except WorkloadError as e:
        console.print(f"[red]error:[/] {e}")
        raise typer.Exit(2)

    try:  # fail fast and clearly when nothing listens there
        import httpx

        probe = httpx.get(base_url.rstrip("/") + "/v1/models", timeout=10.0,
                          headers={"Authorization": f"Bearer {api_key}"} if api_key else None)
    except httpx.HTTPError as e:
        console.print(f"[red]error:[/] cannot reach {base_url}: {type(e).__name__}: {e}")
        raise typer.Exit(2)
    if probe.status_code in (401, 403):  # every request would fail the same way, after the whole sweep
        console.print(f"[red]error:[/] {base_url} refuses {'the' if api_key else 'requests without an'} API key "
                      f"(HTTP {probe.status_code} to GET /v1/models): give a client key of the server with "
                      "--api-key KEY (or DLMIX_API_KEY); a dlmix router's are router.config.api_keys",
                      highlight=False, soft_wrap=True)
        raise typer.Exit(2)
    settings = BenchSettings(base_url=base_url, model=model, endpoint=endpoint, burstiness=burstiness, seed=seed,
                             goodput_ms=slo, percentiles=pcts, engine_urls=engines, timeout_s=timeout,
                             ignore_eos=ignore_eos, api_key=api_key)
    console.print(f"[bold]dlmix bench[/] {workload} -> {base_url}; levels: {', '.join(l.label() for l in levels)}")
    t0 = time.time()
    out = asyncio.run(run_sweep(make, levels, settings, block_for_reuse, progress=lambda m: console.print(m)))
    data = {"label": label, "base_url": base_url, "workload": workload, "started_unix": t0,
            "settings": {"model": model, "endpoint": endpoint, "burstiness": burstiness, "seed": seed,
                         "goodput_ms": slo, "percentiles": pcts, "engine_urls": engines,
                         "gsp": [gsp_num_groups, gsp_prompts_per_group, gsp_system_prompt_len, gsp_question_len,
                                 gsp_output_len] if workload == "shared-prefix" else None,
                         "trace": str(trace) if trace else None},
            "levels": out["levels"]}
    try:
        run_dir = report.write_results(output_dir, label, data, out["results"])
    except OSError as e:
        report.render_table(data, console)
        console.print(f"[red]error:[/] cannot write the results under {Path(output_dir) / label}: {e}")
        raise typer.Exit(2)
    report.render_table(data, console)
    pngs = report.plot_dir(output_dir)
    console.print(f"results: {run_dir / 'results.json'}; plots: {', '.join(str(p) for p in pngs)}")
    failed = sum(lv["metrics"]["failed"] for lv in out["levels"])
    if failed:
        console.print(f"[yellow]{failed} request(s) failed[/]: "
                      f"{json.dumps([lv['metrics']['errors'] for lv in out['levels']])[:400]}")
        raise typer.Exit(1)
