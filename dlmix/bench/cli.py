"""``dlmix bench``: command-line front end of :mod:`dlmix.bench` (registered in :mod:`dlmix.cli`)."""
from __future__ import annotations

import asyncio
import json
import math
import time
from pathlib import Path
from typing import List, Optional

import typer

from dlmix.bench.workloads import WorkloadError

__all__ = ["bench"]


def _floats(text: str, name: str) -> list[float]:
    out = []
    for t in text.replace(" ", "").split(","):
        if not t:
            continue
        try:
            out.append(math.inf if t.lower() in ("inf", "infinity") else float(t))
        except ValueError:
            raise typer.BadParameter(f"{name}: {t!r} is not a number") from None
    return out


def bench(
    base_url: str = typer.Option("http://127.0.0.1:8000", "--base-url", "--url",
                                 help="OpenAI server root: a dlmix router or one engine"),
    deployment: Optional[Path] = typer.Option(None, "--deployment",
                                              help="dlmix launch YAML: take the router URL and engine URLs from it"),
    model: Optional[str] = typer.Option(None, "--model", help="model name (default: first of /v1/models)"),
    endpoint: str = typer.Option("/v1/completions", "--endpoint"),
    workload: str = typer.Option("shared-prefix", "--workload", "--dataset-name",
                                 help="shared-prefix | random | mooncake"),
    num_prompts: int = typer.Option(0, "--num-prompts", help="random: prompts; mooncake: cap (0 = all)"),
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
    trace_time_scale: float = typer.Option(1.0, "--trace-time-scale", help="multiply trace timestamps"),
    max_input_len: int = typer.Option(0, "--max-input-len", help="cut prompts to this many tokens (0 = no cut)"),
    max_output_len: int = typer.Option(0, "--max-output-len"),
    request_rate: str = typer.Option("inf", "--request-rate",
                                     help="req/s; comma list for a sweep (inf = all at once; 'trace' = timestamps)"),
    max_concurrency: str = typer.Option("", "--max-concurrency", help="cap in-flight requests; comma list sweeps"),
    burstiness: float = typer.Option(1.0, "--burstiness", help="Gamma shape of arrivals (1 = Poisson)"),
    seed: int = typer.Option(0, "--seed"),
    goodput: List[str] = typer.Option([], "--goodput", help="SLOs in ms, e.g. --goodput ttft:500 --goodput tpot:50"),
    metric_percentiles: str = typer.Option("50,90,99", "--metric-percentiles"),
    engine_url: List[str] = typer.Option([], "--engine-url", help="engine roots to scrape for prefix-cache counters"),
    output_dir: Path = typer.Option(Path("bench-results"), "--output-dir"),
    label: str = typer.Option("run", "--label", help="run name (sub-folder; plots compare all labels in the dir)"),
    token_range: str = typer.Option("10:256", "--token-range", help="prompt token ids drawn from [LO, HI)"),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="DLMIX_API_KEY"),
    ignore_eos: bool = typer.Option(True, "--ignore-eos/--no-ignore-eos"),
    timeout: float = typer.Option(600.0, "--timeout", help="per-request timeout, seconds"),
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
        pcts = _floats(metric_percentiles, "--metric-percentiles")
        lo, hi = (int(x) for x in token_range.split(":"))
    except (ValueError, TypeError) as e:
        raise typer.BadParameter(str(e)) from None
    engines = list(engine_url)
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

    if request_rate.strip().lower() == "trace":
        rates: list = [None]
    else:
        rates = _floats(request_rate, "--request-rate")
    concs = [int(c) for c in _floats(max_concurrency, "--max-concurrency")] if max_concurrency else [None]
    if len(rates) > 1 and len(concs) > 1:
        raise typer.BadParameter("sweep either --request-rate or --max-concurrency, not both")
    levels = ([Level(r, concs[0]) for r in rates] if len(rates) >= len(concs)
              else [Level(rates[0], c) for c in concs])

    block_for_reuse = 16
    try:
        if workload == "shared-prefix":
            def make(s: int):
                return workloads.shared_prefix(gsp_num_groups, gsp_prompts_per_group, gsp_system_prompt_len,
                                               gsp_question_len, gsp_output_len, seed=s, token_lo=lo, token_hi=hi)
        elif workload == "random":
            def make(s: int):
                return workloads.random_prompts(num_prompts or 32, random_input_len, random_output_len, seed=s,
                                                token_lo=lo, token_hi=hi)
        elif workload == "mooncake":
            if trace is None:
                raise typer.BadParameter("--workload mooncake needs --trace FILE")
            reqs = workloads.load_mooncake_trace(trace, trace_block_tokens, seed, num_prompts or None,
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

        httpx.get(base_url.rstrip("/") + "/v1/models", timeout=10.0,
                  headers={"Authorization": f"Bearer {api_key}"} if api_key else None)
    except httpx.HTTPError as e:
        console.print(f"[red]error:[/] cannot reach {base_url}: {type(e).__name__}: {e}")
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
    run_dir = report.write_results(output_dir, label, data, out["results"])
    report.render_table(data, console)
    pngs = report.plot_dir(output_dir)
    console.print(f"results: {run_dir / 'results.json'}; plots: {', '.join(str(p) for p in pngs)}")
    failed = sum(lv["metrics"]["failed"] for lv in out["levels"])
    if failed:
        console.print(f"[yellow]{failed} request(s) failed[/]: "
                      f"{json.dumps([lv['metrics']['errors'] for lv in out['levels']])[:400]}")
        raise typer.Exit(1)
