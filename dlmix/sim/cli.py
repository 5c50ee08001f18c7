"""``dlmix sim``: simulate a deployment under one or more routing policies and print/write the metrics.

Examples::

    dlmix sim --deployment hetero_pd --model llama-3.1-8b --workload mooncake --speedup 0.5 --policy cost,round_robin
    dlmix sim --deployment my.yaml --workload synthetic --groups 16 --prefix-len 6144 --suffix-len 1200 --rate 4
    dlmix sim --deployment smollm2_cpu --model smollm2 --workload trace.jsonl --out results/
    dlmix sim --deployment out/deploy_sim.yaml --workload mooncake     # judged against the SLO the plan recorded

Output: a table on stdout, ``<out>/sim.json`` (one summary per policy) and PNG plots (TTFT CDF, goodput bars,
per-instance utilization) when ``--out`` is given. The last stdout line is the JSON list of summaries.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import List, Optional

import typer


DEFAULT_SLO_TTFT_MS = 2000.0
DEFAULT_SLO_ITL_MS = 25.0


def build_workload(workload: str, speedup: float = 1.0, limit: Optional[int] = None, groups: int = 16,
                   per_group: int = 16, prefix_len: int = 6144, suffix_len: int = 1200, output_len: int = 128,
                   rate: float = 4.0, seed: int = 0, block_size: int = 512):
    """Requests for ``workload``: ``synthetic`` (shared-prefix generator; ``rate × speedup`` req/s, one hash id per
    ``block_size`` tokens: ``dlmix sim`` passes the deployment's :meth:`~dlmix.sim.config.Deployment.hash_block`),
    a built-in trace name (``mooncake``) or a Mooncake-format JSONL path (its own 512-token hash blocks;
    ``block_size`` is not used). Token arguments in tokens, ``rate`` in req/s. Raises WorkloadError."""
    from dlmix.sim.workload import WorkloadError, load_trace, shared_prefix
    from dlmix.workloads import check_shared_prefix

    if workload.startswith("synthetic:"):  # the planner's spelling (dlmix plan -w synthetic:k=v,...)
        raise WorkloadError(f"workload {workload!r}: dlmix sim takes -w synthetic with its own flags (--groups, "
                            "--per-group, --prefix-len, --suffix-len, --output-len, --rate, --seed), not "
                            "synthetic:KEY=VALUE")
    if workload == "synthetic":
        check_shared_prefix(groups, per_group, prefix_len, suffix_len, output_len,
                            names=("--groups", "--per-group", "--prefix-len", "--suffix-len", "--output-len"))
        reqs = shared_prefix(groups, per_group, prefix_len, suffix_len, output_len, rate * speedup, seed,
                             trace_block=block_size)
        return reqs if limit is None else reqs[:max(limit, 0)]
    return load_trace(workload, speedup=speedup, limit=limit, generators=("synthetic",))


def resolve_slo(dep, slo_ttft_ms: Optional[float] = None, slo_itl_ms: Optional[float] = None):
    """The goodput SLO of a run, per target: the flag when given, else the deployment file's ``slo`` (written by
    ``dlmix plan``: the SLO the deployment was planned for), else the defaults (TTFT 2000 ms, ITL 25 ms).

    Args:
        dep: :class:`~dlmix.sim.config.Deployment`. slo_ttft_ms / slo_itl_ms: the ``--slo-*`` flags, ms (None: not
            given).
    Returns:
        ``(ttft_s, itl_s, source)``, targets in seconds; ``source`` says where each came from
        (``flag``/``deployment``/``default``), e.g. ``"ttft: deployment, itl: flag"``.
    Raises:
        ValueError: a flag <= 0 or not finite (inf, nan).
    """
    out, src = [], []
    for name, flag, planned, default in (("ttft", slo_ttft_ms, dep.slo_ttft, DEFAULT_SLO_TTFT_MS),
                                         ("itl", slo_itl_ms, dep.slo_itl, DEFAULT_SLO_ITL_MS)):
        if flag is not None:
            if not 0 < flag < float("inf"):
                raise ValueError(f"--slo-{name}-ms must be a finite number > 0, got {flag:g}")
            out.append(flag / 1000.0)
            src.append(f"{name}: flag")
        elif planned is not None:
            out.append(planned)
            src.append(f"{name}: deployment")
        else:
            out.append(default / 1000.0)
            src.append(f"{name}: default")
    return out[0], out[1], ", ".join(src)


#: the flags of the synthetic generator: an error with a trace workload, which brings its own requests
SYNTHETIC_FLAGS = ("groups", "per_group", "prefix_len", "suffix_len", "output_len", "rate")


def sim_command(
    ctx: typer.Context,
    deployment: str = typer.Option(..., "--deployment", "-d", help="deployment YAML path or built-in name "
                                   "(homog_h100x4, hetero_pd, h100x8, smollm2_cpu)"),
    model: str = typer.Option("llama-3.1-8b", "--model", "-m", help="preset (llama-3.1-8b, qwen2.5-7b, qwen3-8b, "
                              "smollm2) or a HF config.json path"),
    workload: str = typer.Option("mooncake", "--workload", "-w", help="mooncake | synthetic | trace.jsonl[.gz]"),
    policy: str = typer.Option("cost", "--policy", "-p", help="policy name, or a comma-separated list of distinct "
                               "names to compare"),
    speedup: float = typer.Option(1.0, "--speedup", help="arrival time scale (2 = twice the request rate)"),
    limit: Optional[int] = typer.Option(None, "--limit", help="first N requests only"),
    seed: int = typer.Option(0, "--seed", help="seed of the synthetic workload and of policy tie-breaks"),
    slo_ttft_ms: Optional[float] = typer.Option(
        None, "--slo-ttft-ms", help="goodput TTFT target, ms [default: the deployment file's slo (dlmix plan writes "
        "it), else 2000]"),
    slo_itl_ms: Optional[float] = typer.Option(
        None, "--slo-itl-ms", help="goodput per-request mean ITL (TPOT) target, ms [default: the deployment file's "
        "slo (dlmix plan writes it), else 25]"),
    kv_event_delay_ms: float = typer.Option(0.0, "--kv-event-delay-ms", help="KV event delay to the router, ms"),
    groups: int = typer.Option(16, "--groups", help="synthetic: prefix groups (groups × per-group <= 100000)"),
    per_group: int = typer.Option(16, "--per-group", help="synthetic: requests per group"),
    prefix_len: int = typer.Option(6144, "--prefix-len", help="synthetic: shared prefix tokens (prefix + suffix <= "
                                      "1048576)"),
    suffix_len: int = typer.Option(1200, "--suffix-len", help="synthetic: unique suffix tokens"),
    output_len: int = typer.Option(128, "--output-len", help="synthetic: output tokens (<= 1048576)"),
    rate: float = typer.Option(4.0, "--rate", help="synthetic: request rate, req/s (before --speedup)"),
    out: Optional[str] = typer.Option(None, "--out", "-o", help="folder for sim.json and PNG plots"),
    chips: Optional[List[str]] = typer.Option(
        None, "--chips", help="extra chip catalog YAML (repeatable; as dlmix plan/router --chips, after DLMIX_CHIPS "
        "and dlmix.chips entry points)"),
    policy_param: Optional[List[str]] = typer.Option(
        None, "--policy-param", help="policy argument KEY=VALUE[,KEY=VALUE] (repeatable; the router's flag), given to "
        "every listed policy that declares it (a name no listed policy declares is an error naming the valid ones); "
        "the cost policy gets ttft_target/itl_target from the goodput SLO (--slo-* or the deployment's slo) unless "
        "set here"),
) -> None:
    """Simulate a heterogeneous cluster with the router's own policies (see docs/simulator.md)."""
    from dlmix.router.config import ConfigError as RouterConfigError, parse_kv_list
    from dlmix.sim.config import ConfigError, check_model, load_deployment, load_model
    from dlmix.sim.metrics import format_instances, format_table
    from dlmix.routing.policies import POLICIES, split_params
    from dlmix.sim.simulator import Simulator
    from dlmix.paths import folder_problem
    from dlmix.sim.workload import WorkloadError

    if limit is not None and limit < 1:
        typer.echo(f"error: --limit must be >= 1, got {limit}", err=True)
        raise typer.Exit(2)
    if workload != "synthetic":
        # by name: typer may carry its own copy of click's ParameterSource enum
        given = [f"--{n.replace('_', '-')}" for n in SYNTHETIC_FLAGS
                 if getattr(ctx.get_parameter_source(n), "name", None) == "COMMANDLINE"]
        if given:  # before: ignored without a word, the run simulated the trace as it is
            typer.echo(f"error: {', '.join(given)} shape{'' if len(given) > 1 else 's'} the synthetic workload "
                       f"(-w synthetic), not the trace {workload!r}, which brings its own requests (--speedup scales "
                       "its arrival times, --limit takes its first N)", err=True)
            raise typer.Exit(2)
    if not 0 <= kv_event_delay_ms < float("inf"):
        typer.echo(f"error: --kv-event-delay-ms must be a finite number >= 0, got {kv_event_delay_ms:g}", err=True)
        raise typer.Exit(2)
    names = [p.strip() for p in policy.split(",") if p.strip()]
    bad = [n for n in names if n not in POLICIES]
    if bad or not names:
        typer.echo(f"error: unknown policy {bad or policy!r}; choose from {', '.join(POLICIES)}", err=True)
        raise typer.Exit(2)
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:  # refused, not deduplicated: a repeated name is a typo for another policy more often than not
        typer.echo(f"error: --policy lists {', '.join(dup)} more than once; give each policy once", err=True)
        raise typer.Exit(2)
    try:
        params = {}
        for item in policy_param or []:
            params.update(parse_kv_list(item))
        per_policy = split_params(names, params)
        if chips:
            from dlmix.hw.profiles import load_catalog

            dep = load_deployment(deployment, catalog=load_catalog(chips))
        else:
            dep = load_deployment(deployment)
        slo_ttft, slo_itl, slo_src = resolve_slo(dep, slo_ttft_ms, slo_itl_ms)
        if "cost" in per_policy:  # the SLO the goodput is measured against is the operator's target for the policy
            per_policy["cost"].setdefault("ttft_target", slo_ttft)
            per_policy["cost"].setdefault("itl_target", slo_itl)
        for n, pp in per_policy.items():  # bad values are refused before any simulation runs
            POLICIES[n].Params.parse(n, pp)
        spec = load_model(model)
        check_model(dep, spec)  # the planner's TP rule (dlmix.hw.cost.ModelSpec.allowed_tp_sizes)
        reqs = build_workload(workload, speedup, limit, groups, per_group, prefix_len, suffix_len, output_len,
                              rate, seed, block_size=dep.hash_block())
        if not reqs:
            raise WorkloadError(f"workload {workload!r} has no requests")
        problem = folder_problem(out) if out else None
        if problem:  # refused before the runs, not after them
            raise ValueError(f"--out {out}: {problem}")
    except (ConfigError, RouterConfigError, WorkloadError, ValueError) as ex:
        typer.echo(f"error: {ex}", err=True)
        raise typer.Exit(2)
    results = []
    for n in names:
        t = time.perf_counter()
        pp = per_policy[n]
        res = Simulator(dep, spec, n, seed=seed, kv_event_delay=kv_event_delay_ms / 1000.0, policy_params=pp).run(
            reqs, slo_ttft, slo_itl, label=n)
        res.summary["sim_wall_s"] = time.perf_counter() - t
        results.append(res)
    summaries = [r.summary for r in results]
    typer.echo(format_table(summaries, f"{dep.name} | {spec.name} | {workload} ×{speedup} | {len(reqs)} requests | "
                                       f"SLO TTFT {slo_ttft * 1e3:g} ms, ITL {slo_itl * 1e3:g} ms ({slo_src})"))
    typer.echo(format_instances(summaries))
    n_long = summaries[0].get("too_long", 0) if summaries else 0
    if n_long:  # the same requests under every policy
        longest = max(r.input_len + r.output_len for r in reqs)
        typer.echo(f"note: {n_long} of {len(reqs)} requests need more than the {spec.max_model_len}-token context of "
                   f"{spec.name or 'the model'} (prompt + output, up to {longest}): refused at arrival as vLLM refuses "
                   f"them (HTTP 400), counted as failed and not good (summary key too_long)")
    if out:
        from dlmix.sim.plots import plot_results

        d = Path(out)
        d.mkdir(parents=True, exist_ok=True)
        (d / "sim.json").write_text(json.dumps(summaries, indent=1))
        for p in plot_results(results, d, title=f"{dep.name} {workload} x{speedup}"):
            typer.echo(f"wrote {p}")
    typer.echo(json.dumps(summaries))


def register(app: typer.Typer) -> None:
    """Add ``sim`` to the ``dlmix`` CLI."""
    app.command("sim")(sim_command)

