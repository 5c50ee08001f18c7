"""``dlmix plan``: from a chip inventory, a model, an SLO and a workload to a deployment (see docs/plan.md).

Examples::

    dlmix plan -i h100x4_h20x4 -m llama-3.1-8b -w mooncake --slo-ttft-ms 5000 --slo-itl-ms 50 --slo-pct 80 --out p/
    dlmix plan -i my_inventory.yaml -m path/to/config.json -w trace.jsonl --rate 4
    dlmix plan -i mix32 -w synthetic:groups=16,per_group=16,prefix=6144,suffix=1200,output=128 --no-baselines

Prints the recommendation, the candidates and the baselines as tables; with ``--out`` writes ``plan.json``,
``deploy_sim.yaml`` (``dlmix sim -d`` loads it as it is), ``deploy_launch.yaml`` and ``plan.png``. The last stdout
line is the JSON record. Exit code 0 with a plan, 3 when no deployment meets the SLO, 2 on bad input.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer


def plan_command(
    inventory: str = typer.Option(..., "--inventory", "-i", help="inventory YAML or built-in name (h100x4_h20x4, "
                                  "910bx8_h20x4, mix32, s4000x2); at most 512 hosts, 1024 chips per host, 4096 "
                                  "chips in all"),
    model: str = typer.Option("llama-3.1-8b", "--model", "-m", help="preset (llama-3.1-8b, qwen2.5-7b, qwen3-8b, "
                              "smollm2) or a HF config.json path"),
    workload: str = typer.Option("mooncake", "--workload", "-w", help="mooncake | trace.jsonl[.gz] | "
                                 "synthetic[:groups=G,per_group=N,prefix=P,suffix=S,output=O,seed=X] (each key once; "
                                 "G × N <= 100000 requests, 1 <= P + S <= 1048576 tokens, 1 <= O <= 1048576)"),
    requests: int = typer.Option(300, "--requests", "-n",
                                 help="requests in the sample each simulation replays: the first N of a trace (a "
                                      "synthetic workload is all its groups × per_group requests)"),
    rate: str = typer.Option("maximise", "--rate", help="request rate to plan for, req/s, or 'maximise'"),
    slo_ttft_ms: float = typer.Option(2000.0, "--slo-ttft-ms", help="TTFT target, ms"),
    slo_itl_ms: float = typer.Option(50.0, "--slo-itl-ms", help="ITL target (a request's mean inter-token time), ms"),
    slo_pct: float = typer.Option(90.0, "--slo-pct", help="percent of requests that must meet both targets"),
    policy: str = typer.Option("cost", "--policy", "-p", help="router policy simulated for every candidate"),
    block_size: int = typer.Option(64, "--block-size", help="default KV block size, tokens"),
    top_k: int = typer.Option(4, "--top-k", help="analytically best role patterns simulated"),
    no_refine: bool = typer.Option(False, "--no-refine", help="skip the refinement (TP local search, "
                                   "policy and block-size variants)"),
    with_baselines: bool = typer.Option(True, "--baselines/--no-baselines", help="also simulate the baselines"),
    chips: Optional[List[str]] = typer.Option(None, "--chips", help="extra chip catalog YAML (repeatable)"),
    out: Optional[str] = typer.Option(None, "--out", "-o", help="folder for plan.json, deployment files, plan.png"),
    seed: int = typer.Option(0, "--seed", help="simulator seed"),
    max_num_batched_tokens: int = typer.Option(8192, "--max-num-batched-tokens",
                                               help="engine token budget per iteration (every instance)"),
    max_num_seqs: int = typer.Option(256, "--max-num-seqs", help="engine running-sequence limit (every instance)"),
) -> None:
    """Plan a deployment of a model on a chip inventory for an SLO and a workload (docs/plan.md)."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from dlmix.hw.profiles import CatalogError, load_catalog
    from dlmix.plan.analytic import SLO
    from dlmix.plan.baselines import baselines
    from dlmix.plan.inventory import InventoryError, load_inventory
    from dlmix.plan.report import result_dict, tables, write_outputs
    from dlmix.paths import folder_problem
    from dlmix.plan.search import Planner
    from dlmix.plan.workload import load_plan_workload
    from dlmix.sim.config import ConfigError, load_model
    from dlmix.sim.workload import WorkloadError

    con = Console(stderr=False)
    if not con.is_terminal:
        con = Console(stderr=False, width=160)
    try:
        try:
            r_val = None if rate.strip().lower() in ("max", "maximise", "maximize") else float(rate)
        except ValueError:
            raise ValueError(f"--rate: a request rate in req/s or 'maximise' is expected, got {rate!r}") from None
        import math

        for flag, v, ok in (("--rate", r_val, r_val is None or 0 < r_val < math.inf),
                            ("--slo-ttft-ms", slo_ttft_ms, 0 < slo_ttft_ms < math.inf),
                            ("--slo-itl-ms", slo_itl_ms, 0 < slo_itl_ms < math.inf),
                            ("--slo-pct", slo_pct, 0 < slo_pct <= 100), ("--top-k", top_k, top_k >= 1)):
            if not ok:  # named as the flag, in its unit (the planner's own checks speak seconds and parameters)
                want = {"--slo-pct": "in (0, 100]", "--top-k": "at least 1"}.get(flag, "a positive finite number")
                raise ValueError(f"{flag} must be {want}, got {v:g}")
        problem = folder_problem(out) if out else None
        if problem:  # refused before the search, not after it
            raise ValueError(f"--out {out}: {problem}")
        cat = load_catalog(chips)
        inv = load_inventory(inventory, cat)
        cpu = [g.chip for g in inv.groups if inv.catalog.chip(g.chip).vendor == "generic"]
        if cpu and block_size % 32:  # else deploy_launch.yaml is a file `dlmix launch` refuses
            raise ValueError(f"--block-size {block_size}: the CPU chip type(s) {', '.join(cpu)} run vLLM CPU, which "
                             "needs a KV block size that is a multiple of 32")
        spec = load_model(model)
        wl = load_plan_workload(workload, requests, block_size)
        slo = SLO(slo_ttft_ms / 1000.0, slo_itl_ms / 1000.0, slo_pct)
        import dlmix.sim  # noqa: F401  (registers the simulator-only oracle)
        from dlmix.routing.policies import POLICIES

        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
        with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                      TimeElapsedColumn(), console=Console(stderr=True), transient=True) as prog:
            task = prog.add_task("planning", total=1)

            def cb(msg: str, done: int, total: int) -> None:
                prog.update(task, description=msg[:90], completed=done, total=max(total, 1))

            pl = Planner(inv, spec, slo, wl, r_val, policy, block_size, seed, progress=cb,
                         engine={"max_num_batched_tokens": max_num_batched_tokens, "max_num_seqs": max_num_seqs})
            res = pl.plan(top_k=top_k, refine=not no_refine)
            base = baselines(pl, progress=cb) if (with_baselines and res.feasible) else None
    except (InventoryError, CatalogError, ConfigError, WorkloadError, ValueError) as ex:
        typer.echo(f"error: {ex}", err=True)
        raise typer.Exit(2)
    for t in tables(res, base):
        con.print(t)
    if out:
        # a config.json path: the launch file names its folder (what vLLM loads)
        ref = None if not Path(model).exists() else str(Path(model).parent) if Path(model).is_file() else model
        try:
            written = write_outputs(pl, res, Path(out), base, model_ref=ref, chips=chips)
        except OSError as ex:  # the folder check passed but writing failed (e.g. /proc, a full disk)
            typer.echo(f"error: --out {out}: {ex}", err=True)
            raise typer.Exit(2)
        for p in written:
            con.print(f"wrote {p}")
    typer.echo(json.dumps({k: v for k, v in result_dict(res, base).items() if k != "simulated"}))
    if not res.feasible:
        raise typer.Exit(3)


def register(app: typer.Typer) -> None:
    """Add ``plan`` to the ``dlmix`` CLI."""
    app.command("plan")(plan_command)
