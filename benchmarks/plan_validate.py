"""dlmix plan against real engines: the planner's predicted goodput and ranking of SmolLM2 deployments on this
machine's two CPU cores, next to the goodput ``dlmix bench`` measures on the same deployments run by ``dlmix launch``.

1. **Calibration on this machine** (``dlmix.sim.calibrate``): a vLLM CPU server pinned to core 0 while a second
   one on core 1 is kept busy (the engines of a two-engine deployment load each other's core with their API
   servers), then one server on cores 0-1 alone (``calib_1core.json``, ``calib_2core.json``; ``--calib-dir``
   reuses them). The planner's inventory is this
   machine: ``cpu-x86: 2`` with those profiles as its ``timing`` (a "chip" is a core), KV link ``tcp-10g``.
2. **Workload**: a shared-prefix sample (default 8 groups × 6 requests, prefix 512 + suffix 512 tokens, 64 output
   tokens) written as a Mooncake-format trace; the planner replays it, and ``dlmix bench`` replays the same trace
   (same arrivals scaled to the rate, same prefix structure; run ``k`` draws other token ids, so no run hits the
   prefixes of an earlier one). SLO (default): 90 % of requests within TTFT 1 s and TPOT 60 ms.
3. **Plan and predictions**: ``Planner.plan()`` picks a deployment; each candidate (one engine on 2 cores; two
   engines on one core each; 1 prefill + 1 decode engine on one core each, KV block 32 and 128) is simulated for
   its goodput (largest rate on the 1.07 grid meeting the SLO), with the engine settings of the calibration
   (``--max-num-batched-tokens 2048 --max-num-seqs 64``) and the router's ``cost`` policy.
4. **Measurement**: each candidate's ``dlmix launch`` file (``dlmix.plan.report.launch_deployment``) is started,
   and :func:`measure_goodput` searches from the predicted goodput, by factors of 1.15, the largest rate at which
   the SLO holds in a ``dlmix bench`` replay of the sample (failed requests count as misses).

Figures (last stdout line, one JSON object): ``predicted_goodput`` and ``measured_goodput`` per candidate (req/s),
``predicted_rank`` / ``measured_rank``, ``plan`` (the planner's choice), ``top_choice_agrees`` (the plan is the
measured best), ``plan_choice_vs_measured_best`` (measured goodput of the plan's choice / the best measured;
1.0 = agreement), ``plan_prediction_error`` (predicted / measured − 1 for the plan's choice), and per candidate
the attainment at every rate tried with the latency percentiles.

    python benchmarks/plan_validate.py --quick          # 3 deployments, 32 requests (~15 min on 2 cores)
    python benchmarks/plan_validate.py                  # 4 deployments, 48 requests (~25 min)

The measured goodput has the resolution of the 1.15 rate steps; the machine must be otherwise idle (each rate's
record has ``other_cpu_s``, CPU time spent outside the deployment and the bench client, to show interference).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

STEP = 1.15              # rate factor between two tries
DOWN_LIMIT = 2.0         # search down to start_rate / DOWN_LIMIT (5 rates at most: runs at low rates are long)
HOPELESS = 0.6           # ... but stop after 3 rates in a row whose attainment is below HOPELESS × target
TOKEN_LO, TOKEN_HI = 10, 256   # dlmix bench's default --token-range; run k shifts it by k (fresh prefixes)

__all__ = ["measure_goodput", "goodput_search", "write_deployment", "LaunchedDeployment", "bench_once",
           "attainment_of", "process_tree"]


# ---- processes ----------------------------------------------------------------------------------------------

def _stat(pid: int) -> Optional[List[str]]:
    """Fields of ``/proc/PID/stat`` after the command name (state, ppid, pgrp, ...), or None when gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _alive(pid: int) -> bool:
    f = _stat(pid)
    return f is not None and f[0] != "Z"


def process_tree(root: int) -> Dict[int, int]:
    """``{pid: pgid}`` of ``root`` and every live descendant (Linux ``/proc``)."""
    parent: Dict[int, int] = {}
    pgid: Dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            f = _stat(int(d.name))
            if f is not None and f[0] != "Z":
                parent[int(d.name)] = int(f[1])
                pgid[int(d.name)] = int(f[2])
    out = {root: pgid[root]} if root in pgid else {}
    grew = True
    while grew:
        grew = False
        for p, pp in parent.items():
            if pp in out and p not in out:
                out[p] = pgid[p]
                grew = True
    return out


def _ps_left(pids: set, pgids: set) -> List[str]:
    """``ps`` lines of live processes whose pid is in ``pids`` or whose process group is in ``pgids``."""
    r = subprocess.run(["ps", "-eo", "pid=,pgid=,stat=,args="], capture_output=True, text=True, check=False)
    out = []
    for line in r.stdout.splitlines():
        parts = line.split(None, 3)
        if len(parts) < 3 or parts[2].startswith("Z"):
            continue
        pid, pg = int(parts[0]), int(parts[1])
        if pid != os.getpid() and (pid in pids or pg in pgids):
            out.append(line.strip()[:200])
    return out


def write_deployment(deploy: dict, path: Path) -> Path:
    """Write ``deploy`` (a ``dlmix launch`` mapping) as YAML to ``path`` after validating it with
    :class:`dlmix.launch.config.Deployment` (raises its ConfigError); returns ``path``."""
    from dlmix.launch.config import Deployment

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(deploy, sort_keys=False))
    Deployment.from_file(path)
    return path


class LaunchedDeployment:
    """``python -m dlmix.cli launch FILE --log-dir DIR`` in a session of its own, its output in ``DIR/launch.out``.

    :meth:`wait_ready` waits for launch's own ``ready`` line, the entry point's ``/v1/models`` (non-empty) and every
    instance's ``/health`` and remembers every process under launch (pids and process groups);
    :meth:`stop` sends SIGINT to launch (its clean stop: SIGINT to every group it started, SIGKILL after
    ``grace_s``), waits, then lists with ``ps`` what is left of the remembered processes, SIGKILLs it and returns
    those lines (empty: nothing left). Context manager: stops on exit.
    """

    def __init__(self, dep_file: Path, log_dir: Path, grace_s: float = 10.0):
        from dlmix.engine_process import die_with_parent
        from dlmix.launch.config import Deployment

        self.dep_file = Path(dep_file)
        self.dep = Deployment.from_file(self.dep_file)
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.grace_s = grace_s
        self.url = self.dep.entry_url()
        self.engine_urls = [i.url for i in self.dep.instances]
        self.tracked: Dict[int, int] = {}
        self.orphans: List[str] = []
        self._out_path = self.log_dir / "launch.out"
        self._out = open(self._out_path, "wb")
        env = {**os.environ, "COLUMNS": "200"}
        # die_with_parent: killed by a signal (``timeout``, Ctrl-C of a shell, SIGKILL), this script leaves no
        # deployment behind (``dlmix launch`` stops its engines on the SIGTERM it then gets)
        self.proc = subprocess.Popen(die_with_parent([sys.executable, "-m", "dlmix.cli", "launch", str(self.dep_file),
                                                      "--log-dir", str(self.log_dir), "--grace", str(grace_s)]),
                                     stdout=self._out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True, cwd=str(ROOT), env=env)
        self.t_start = time.monotonic()
        self.startup_s: Optional[float] = None

    def output(self) -> str:
        """What ``dlmix launch`` printed so far."""
        return self._out_path.read_text(errors="replace")

    def _track(self) -> None:
        if self.proc.poll() is None:
            self.tracked.update(process_tree(self.proc.pid))

    def wait_ready(self, timeout_s: float = 900.0) -> float:
        """Block until ready (class doc); returns the start-up time in seconds. Raises RuntimeError (with the tail of
        launch's output) when launch exits or ``timeout_s`` passes."""
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=5.0) as c:
            while True:
                self._track()
                if self.proc.poll() is not None:
                    raise RuntimeError(f"dlmix launch exited with code {self.proc.returncode}:\n"
                                       f"{self.output()[-3000:]}")
                if self._ready(c):
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"deployment not ready after {timeout_s:.0f} s:\n{self.output()[-3000:]}")
                time.sleep(1.0)
        self._track()
        self.startup_s = time.monotonic() - self.t_start
        return self.startup_s

    def _ready(self, c: httpx.Client) -> bool:
        if "ready" not in self.output():
            return False
        try:
            r = c.get(self.url + "/v1/models")
            if r.status_code != 200 or not (r.json().get("data") or []):
                return False
            return all(c.get(u + "/health").status_code == 200 for u in self.engine_urls)
        except (httpx.HTTPError, ValueError):
            return False

    def stop(self, timeout_s: float = 180.0) -> List[str]:
        """Stop everything and check for leftovers (class doc); returns the ``ps`` lines of processes that were
        still alive after launch's own stop (killed now)."""
        self._track()
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        self._out.close()
        pids, pgids = set(self.tracked), set(self.tracked.values()) - {os.getpgid(0)}
        deadline = time.monotonic() + 10.0  # SIGKILL is asynchronous: a killed group may need a moment to go
        while (left := _ps_left(pids, pgids)) and time.monotonic() < deadline:
            time.sleep(0.2)
        self.orphans = left
        for line in left:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(line.split()[0]), signal.SIGKILL)
        return left

    def __enter__(self) -> "LaunchedDeployment":
        return self

    def __exit__(self, *exc) -> None:
        if not self._out.closed:  # not stopped yet
            self.stop()


# ---- one bench run ------------------------------------------------------------------------------------------

def _steal_s() -> float:
    """CPU time stolen from this (virtual) machine so far, seconds, all cores (``/proc/stat``; 0 when unreadable)."""
    try:
        f = Path("/proc/stat").read_text().splitlines()[0].split()
        return int(f[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def _busy_s() -> float:
    """Busy CPU time of the machine so far (user, nice, system, irq, softirq of ``/proc/stat``), seconds."""
    try:
        f = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        return (f[0] + f[1] + f[2] + f[5] + f[6]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def _tree_cpu_s(pids) -> float:
    """utime + stime of the live processes ``pids`` (and of their reaped children), seconds."""
    tot = 0
    for p in pids:
        f = _stat(p)
        if f is not None:
            tot += sum(int(x) for x in f[11:15])
    return tot / os.sysconf("SC_CLK_TCK")


def warm_up(url: str, timeout_s: float = 300.0) -> float:
    """One completion (16 prompt tokens, 4 output tokens) through ``url``; returns its seconds."""
    with httpx.Client(timeout=timeout_s) as c:
        model = c.get(url + "/v1/models").json()["data"][0]["id"]
        t0 = time.perf_counter()
        r = c.post(url + "/v1/completions", json={"model": model, "prompt": list(range(100, 116)), "max_tokens": 4,
                                                  "temperature": 0.0})
        r.raise_for_status()
        return time.perf_counter() - t0


def attainment_of(requests_jsonl: Path, ttft_s: float, tpot_s: float) -> Dict[str, float]:
    """Share of *all* requests sent (failed ones count as misses) with TTFT <= ``ttft_s`` and TPOT <= ``tpot_s``
    (a request with one output token has no TPOT and meets that target), from a ``dlmix bench`` requests.jsonl;
    with ``n``, ``good`` and ``failed``."""
    rows = [json.loads(x) for x in Path(requests_jsonl).read_text().splitlines() if x.strip()]
    good = sum(1 for r in rows if r["success"] and r["ttft"] <= ttft_s and (r.get("tpot") or 0.0) <= tpot_s)
    return {"attainment": good / len(rows) if rows else 0.0, "n": len(rows), "good": good,
            "failed": sum(1 for r in rows if not r["success"])}


def bench_once(dep_file: Path, workload: dict, slo: dict, rate: float, out_dir: Path, label: str, run_index: int = 0,
               timeout_s: float = 900.0) -> dict:
    """One ``dlmix bench`` run of the whole shared-prefix sample at ``rate`` req/s (Poisson arrivals, seed
    ``workload["seed"]``, so every run has the same arrival pattern scaled by the rate). The token range is shifted
    by ``run_index`` so no run hits prefixes cached by an earlier run on the same deployment (the offsets drawn
    stay those of the seed: same sample shape, other token ids).

    Returns ``{"rate", "attainment", "n", "good", "failed", "good_fraction_bench", "ttft_ms": {p50, p90},
    "tpot_ms": {p50, p90}, "wall_s", "steal_s" (CPU time the hypervisor took meanwhile), "bench_rc"}``.
    Raises RuntimeError when bench gives no results.json."""
    w, s = workload, slo
    cmd = [sys.executable, "-m", "dlmix.cli", "bench", "--deployment", str(dep_file)]
    if "trace" in w:  # replay a Mooncake-format trace, its timestamps scaled to ``rate`` (the planner's sample)
        cmd += ["--workload", "mooncake", "--trace", str(w["trace"]), "--request-rate", "trace",
                "--trace-time-scale", f"{w['base_rate'] / rate:.6g}", "--seed", str(run_index)]
    else:
        cmd += ["--workload", "shared-prefix", "--gsp-num-groups", str(w["groups"]),
                "--gsp-prompts-per-group", str(w["per_group"]), "--gsp-system-prompt-len", str(w["prefix"]),
                "--gsp-question-len", str(w["suffix"]), "--gsp-output-len", str(w["output"]),
                "--request-rate", f"{rate:.6g}", "--seed", str(w.get("seed", 0)),
                "--token-range", f"{TOKEN_LO + run_index}:{TOKEN_HI + run_index}"]
    cmd += ["--goodput", f"ttft:{s['ttft_s'] * 1000:g}", "--goodput", f"tpot:{s['itl_s'] * 1000:g}",
            "--metric-percentiles", "50,90", "--output-dir", str(out_dir), "--label", label, "--timeout", "300"]
    t0, steal0 = time.monotonic(), _steal_s()
    with open(Path(out_dir) / f"{label}.out", "wb") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=str(ROOT), timeout=timeout_s,
                            env={**os.environ, "COLUMNS": "200"}).returncode
    wall, steal = time.monotonic() - t0, _steal_s() - steal0
    res = Path(out_dir) / label / "results.json"
    if not res.exists():
        tail = (Path(out_dir) / f"{label}.out").read_text()[-2000:]
        raise RuntimeError(f"dlmix bench (rc {rc}) wrote no {res}: {tail}")
    m = json.loads(res.read_text())["levels"][0]["metrics"]
    att = attainment_of(Path(out_dir) / label / "requests.jsonl", s["ttft_s"], s["itl_s"])
    return {"rate": rate, **att, "good_fraction_bench": m.get("good_fraction"),
            "ttft_ms": {"p50": m["ttft_ms"]["p50"], "p90": m["ttft_ms"]["p90"]},
            "tpot_ms": {"p50": m["tpot_ms"]["p50"], "p90": m["tpot_ms"]["p90"]}, "wall_s": wall, "steal_s": steal,
            "bench_rc": rc}


# ---- the search ---------------------------------------------------------------------------------------------

def goodput_search(attain: Callable[[float], float], target: float, start_rate: float,
                   rates: Optional[List[float]] = None, step: float = STEP, down_limit: float = DOWN_LIMIT,
                   max_tries: int = 16, max_rate: float = math.inf) -> Dict[str, object]:
    """Largest rate whose attainment (``attain(rate)``, a share 0..1) is >= ``target``.

    With ``rates``: each is tried (ascending) and the goodput is the largest that meets the target. Otherwise from
    ``start_rate``: up by ``step`` while the target is met (at most ``max_tries`` runs, no rate above ``max_rate``),
    or down by ``step`` until it is met, not below ``start_rate / down_limit`` and not after 3 rates in a row
    whose attainment is below ``HOPELESS × target`` (the SLO is missed at low load: latency, not queueing; goodput
    0 if none meets it). Returns ``{"goodput", "tried": {rate: attainment}, "capped"}`` (rates rounded to 4 digits as keys;
    ``capped``: the largest rate tried met the target, so the goodput is only a lower bound: raise ``max_tries`` /
    ``max_rate``, or use a larger sample when even a burst of the whole sample meets the target)."""
    tried: Dict[float, float] = {}

    def meets(r: float) -> bool:
        a = attain(r)
        tried[round(r, 4)] = a
        return a >= target - 1e-12

    if rates:
        ok = [r for r in sorted(rates) if meets(r)]
        return {"goodput": max(ok) if ok else 0.0, "tried": tried, "capped": bool(ok) and max(ok) == max(rates)}
    r, best, capped = start_rate, 0.0, False
    if meets(r):
        best = r
        while True:
            if len(tried) >= max_tries or r * step > max_rate:
                capped = True
                break
            if not meets(r * step):
                break
            r *= step
            best = r
    else:
        floor = start_rate / down_limit
        low = 1 if tried[round(r, 4)] < HOPELESS * target else 0
        while r / step >= floor * (1 - 1e-9) and low < 3:
            r /= step
            if meets(r):
                best = r
                break
            low = low + 1 if tried[round(r, 4)] < HOPELESS * target else 0
    return {"goodput": round(best, 4), "tried": tried, "capped": capped}


def measure_goodput(deploy: dict, workload: dict, slo: dict, rates: Optional[List[float]], start_rate: float,
                    out_dir: Path, *, ready_timeout_s: float = 900.0, grace_s: float = 10.0,
                    max_tries: int = 16, max_rate: float = math.inf,
                    log: Callable[[str], None] = lambda m: print(m, file=sys.stderr, flush=True)) -> dict:
    """Measured goodput of a real deployment.

    Args:
        deploy: ``dlmix launch`` deployment mapping (docs/launch.md); written to ``out_dir/deployment.yaml``.
        workload: shared-prefix sample: ``groups``, ``per_group``, ``prefix``, ``suffix``, ``output`` (tokens),
            ``seed``.
        slo: ``ttft_s`` (s), ``itl_s`` (s, checked as ``dlmix bench``'s per-request TPOT), ``pct`` (% of requests
            that must meet both).
        rates: explicit rates to try instead of the search (None: search from ``start_rate``).
        start_rate: first rate of the search, req/s (:func:`goodput_search`, factor 1.15, down to start/2;
            ``max_tries`` runs at most, none above ``max_rate``).
        out_dir: launch logs (``logs/``), bench results (``bench/<label>/``), ``measure.json``.
    Returns ``{"goodput", "tried": {rate: attainment}, "per_rate": {rate: {"ttft_p50_ms", "ttft_p90_ms",
    "tpot_p50_ms", "tpot_p90_ms", "n", "good", "failed", "wall_s", "steal_s", "other_cpu_s"}}, "startup_s",
    "warmup_s", "wall_s", "orphans", "capped"}`` (``capped``: see :func:`goodput_search`; ``other_cpu_s``: CPU
    seconds the machine spent outside the deployment and the bench client during the run, a sign of interference;
    ``orphans``: ``ps`` lines of processes still alive after launch's stop, killed then; empty when clean).
    Raises RuntimeError when the deployment does not come up (everything started is stopped first).
    """
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    dep_file = write_deployment(deploy, out_dir / "deployment.yaml")
    bench_dir = out_dir / "bench"
    bench_dir.mkdir(exist_ok=True)
    t0 = time.monotonic()
    per_rate: Dict[float, dict] = {}
    launched = LaunchedDeployment(dep_file, out_dir / "logs", grace_s=grace_s)
    try:
        startup = launched.wait_ready(ready_timeout_s)
        log(f"[plan_validate] {dep_file.name} ready in {startup:.1f} s ({launched.url})")
        warm = warm_up(launched.url)

        def attain(rate: float) -> float:
            k = len(per_rate)
            launched._track()
            busy0, tree0 = _busy_s(), _tree_cpu_s(launched.tracked)
            kids0 = resource.getrusage(resource.RUSAGE_CHILDREN)
            b = bench_once(dep_file, workload, slo, rate, bench_dir, f"run{k:02d}_rate{rate:.4g}", run_index=k)
            kids1 = resource.getrusage(resource.RUSAGE_CHILDREN)
            ours = (_tree_cpu_s(launched.tracked) - tree0 + kids1.ru_utime + kids1.ru_stime - kids0.ru_utime
                    - kids0.ru_stime)
            b["other_cpu_s"] = max(0.0, _busy_s() - busy0 - ours)
            per_rate[round(rate, 4)] = {"ttft_p50_ms": b["ttft_ms"]["p50"], "ttft_p90_ms": b["ttft_ms"]["p90"],
                                        "tpot_p50_ms": b["tpot_ms"]["p50"], "tpot_p90_ms": b["tpot_ms"]["p90"],
                                        "n": b["n"], "good": b["good"], "failed": b["failed"],
                                        "wall_s": round(b["wall_s"], 1), "steal_s": round(b["steal_s"], 2),
                                        "other_cpu_s": round(b["other_cpu_s"], 2)}
            log(f"[plan_validate] rate {rate:.3f}: attainment {b['attainment']:.3f} ({b['good']}/{b['n']}), "
                f"TTFT p50/p90 {b['ttft_ms']['p50']:.0f}/{b['ttft_ms']['p90']:.0f} ms, TPOT p50/p90 "
                f"{b['tpot_ms']['p50']:.1f}/{b['tpot_ms']['p90']:.1f} ms, {b['wall_s']:.1f} s (CPU of other processes "
                f"{b['other_cpu_s']:.1f} s, steal {b['steal_s']:.2f} s)")
            return b["attainment"]

        found = goodput_search(attain, slo["pct"] / 100.0, start_rate, rates, max_tries=max_tries,
                               max_rate=max_rate)
    finally:
        orphans = launched.stop()
        if orphans:
            log(f"[plan_validate] processes left after launch's stop (killed now): {orphans}")
    out = {"goodput": found["goodput"], "capped": found["capped"], "tried": found["tried"], "per_rate": per_rate,
           "startup_s": round(startup, 1),
           "warmup_s": round(warm, 2), "wall_s": round(time.monotonic() - t0, 1), "orphans": orphans}
    (out_dir / "measure.json").write_text(json.dumps(out, indent=1))
    return out


# ---- the validation ------------------------------------------------------------------------------------------

#: (name, choices as (role, size, instances), KV block size): the deployments of SmolLM2 on this machine's 2 cores
CANDIDATES = (
    ("agg_2core_x1", (("both", 2, 1),), 32),
    ("agg_1core_x2", (("both", 1, 2),), 32),
    ("pd_1p1d_bs32", (("prefill", 1, 1), ("decode", 1, 1)), 32),
    ("pd_1p1d_bs128", (("prefill", 1, 1), ("decode", 1, 1)), 128),
)
ENGINE = {"max_num_batched_tokens": 2048, "max_num_seqs": 64}  # the calibration's settings, on every engine
CACHE_BYTES = 1 << 30  # KV cache per engine (vLLM CPU's VLLM_CPU_KVCACHE_SPACE): holds the sample's peak


def _calibrations(calib_dir: Path, log) -> Dict[int, Path]:
    """``{size: profile path}`` for 1 and 2 cores, measured now unless ``calib_dir`` already holds them."""
    from dlmix.sim.calibrate import calibrate

    calib_dir.mkdir(parents=True, exist_ok=True)
    out = {}
    for size, cpus, neighbour in ((1, "0", "1"), (2, "0-1", None)):
        p = calib_dir / f"calib_{size}core.json"
        if not p.exists():
            log(f"[plan_validate] calibrating vLLM CPU on cores {cpus} (busy neighbour on {neighbour}) ...")
            doc = calibrate(p, cpus=cpus, name=f"smollm2_vllm_cpu_{size}core", neighbour_cpus=neighbour)
            log(f"[plan_validate]   {doc['coefficients']} (fit mean error {doc['fit']['mean_rel_err']:.3f})")
        out[size] = p
    return out


def _launch_file(pl, c, ports) -> dict:
    """The candidate's launch file as ``dlmix plan`` writes it (:func:`dlmix.plan.report.launch_deployment`: the
    engine settings it simulated, the calibration's), on free ports, with a KV cache that holds the sample."""
    from dlmix.plan.report import launch_deployment

    d = launch_deployment(pl, c, model_ref="smollm2", name="plan-validate")
    d["router"]["port"] = ports[0]
    for k, inst in enumerate(d["instances"]):
        inst["port"] = ports[k + 1]
        inst["kv"]["cache_bytes"] = CACHE_BYTES
    return d


def _calib_summary(path: Path) -> dict:
    """What a profile says of itself: name, source, when, coefficients, fit errors."""
    d = json.loads(Path(path).read_text())
    return {k: d.get(k) for k in ("name", "source", "measured_at", "coefficients", "fit")}


def _rank(values: Dict[str, float]) -> List[str]:
    return sorted(values, key=lambda k: -values[k])


def main(argv=None) -> int:
    """The validation (module docstring); prints the side-by-side table, then one JSON line."""
    import argparse
    import tempfile

    from dlmix.plan.analytic import SLO
    from dlmix.plan.inventory import load_inventory
    from dlmix.plan.search import Candidate, GroupChoice, Planner
    from dlmix.plan.workload import load_plan_workload
    from dlmix.sim.config import load_model
    from dlmix.sim.workload import shared_prefix, write_trace
    from dlmix.testing import free_port_block

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="three deployments (no block-128 PD), 32 requests")
    ap.add_argument("--out-dir", default=None, help="default: a new temporary folder")
    ap.add_argument("--calib-dir", default=None, help="reuse calib_1core.json / calib_2core.json from here")
    ap.add_argument("--groups", type=int, default=None, help="shared-prefix groups (default 8; --quick 8)")
    ap.add_argument("--per-group", type=int, default=None, help="requests per group (default 6; --quick 4)")
    ap.add_argument("--prefix", type=int, default=512)
    ap.add_argument("--suffix", type=int, default=512)
    ap.add_argument("--output", type=int, default=64)
    ap.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    ap.add_argument("--slo-itl-ms", type=float, default=60.0)
    ap.add_argument("--slo-pct", type=float, default=90.0)
    ap.add_argument("--only", default="", help="comma list of candidate names to measure (default: all)")
    ap.add_argument("--measured-from", default=None,
                    help="take each candidate's measurement from DIR/<name>/measure.json of an earlier run with the "
                         "same workload and SLO (re-plan with new calibrations without re-measuring)")
    a = ap.parse_args(argv)

    def log(m: str) -> None:
        print(m, file=sys.stderr, flush=True)

    t_all = time.monotonic()
    out = Path(a.out_dir or tempfile.mkdtemp(prefix="dlmix-plan-validate-")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    calib = _calibrations(Path(a.calib_dir).resolve() if a.calib_dir else out / "calib", log)
    groups = a.groups or 8
    per_group = a.per_group or (4 if a.quick else 6)
    reqs = shared_prefix(groups, per_group, a.prefix, a.suffix, a.output, 1.0, 0)
    trace = out / "workload.jsonl"
    write_trace(reqs, str(trace))
    wl = load_plan_workload(str(trace), len(reqs))
    slo = SLO(a.slo_ttft_ms / 1000.0, a.slo_itl_ms / 1000.0, a.slo_pct)
    inv = load_inventory({"name": "this-machine-2-cores",
                          "hosts": [{"name": "local", "chips": {"cpu-x86": 2}, "link": "tcp-10g"}],
                          "timing": {"cpu-x86": {k: str(v) for k, v in calib.items()}}})
    pl = Planner(inv, load_model("smollm2"), slo, wl, block_size=32, engine=dict(ENGINE))
    t = time.monotonic()
    res = pl.plan()
    plan_s = time.monotonic() - t
    if not res.feasible:
        log(f"[plan_validate] the plan is infeasible: {res.reasons}")
    cands = {}
    for name, choices, bs in CANDIDATES:
        if a.quick and name == "pd_1p1d_bs128":
            continue
        c = Candidate(tuple(GroupChoice("cpu-x86", r, t_, n) for r, t_, n in choices), "cost", bs)
        c.analytic, c.binding = pl.analytic(c.choices)
        cands[name] = pl.evaluate(c)
    chosen = next((n for n, c in cands.items() if res.best is not None and c.key == res.best.key), None)
    if res.best is not None and chosen is None:  # the plan picked something outside the list: measure it too
        chosen = "plan"
        cands["plan"] = res.best
    predicted = {n: float(c.goodput or 0.0) for n, c in cands.items()}
    log(f"[plan_validate] plan: {res.best.label() if res.best else None} ({plan_s:.1f} s); predicted {predicted}")
    wl_bench = {"trace": str(trace), "base_rate": wl.base_rate}
    slo_d = {"ttft_s": slo.ttft, "itl_s": slo.itl, "pct": slo.pct}
    only = [x for x in a.only.split(",") if x]
    measured: Dict[str, float] = {}
    detail: Dict[str, dict] = {}
    for name, c in cands.items():
        if only and name not in only:
            continue
        base = free_port_block(1 + sum(ch.instances for ch in c.choices))
        dep = _launch_file(pl, c, [base + k for k in range(1 + sum(ch.instances for ch in c.choices))])
        start = predicted[name] if predicted[name] > 0 else 0.5
        prev = Path(a.measured_from) / name / "measure.json" if a.measured_from else None
        if prev is not None and prev.exists():
            m = json.loads(prev.read_text())
            log(f"[plan_validate] {name}: measurement taken from {prev}")
        else:
            log(f"[plan_validate] measuring {name}: {c.label()} from {start:.3f} req/s")
            m = measure_goodput(dep, wl_bench, slo_d, None, start, out / name, log=log)
        measured[name] = float(m["goodput"])
        detail[name] = {"label": c.label(), "predicted": round(predicted[name], 3), "measured": m["goodput"],
                        "capped": m["capped"], "tried": m["tried"], "per_rate": m["per_rate"]}
    names = [n for n in cands if n in measured]
    print(f"\n{'deployment':16} {'label':52} {'predicted':>10} {'measured':>10} {'pred/meas':>10}")
    for n in names:
        p_, m_ = predicted[n], measured[n]
        print(f"{n:16} {cands[n].label():52} {p_:10.3f} {m_:10.3f} {(p_ / m_ if m_ else float('nan')):10.3f}"
              f"{'  <- plan' if n == chosen else ''}")
    pr = _rank({n: predicted[n] for n in names})
    mr = _rank({n: measured[n] for n in names})
    best_meas = max(measured.values()) if measured else 0.0
    rec = {"machine": {"cores": os.cpu_count(), "load_avg_1m_at_end": round(os.getloadavg()[0], 2)},
           "workload": {"groups": groups, "per_group": per_group, "prefix": a.prefix, "suffix": a.suffix,
                        "output": a.output, "requests": len(reqs)},
           "slo": slo_d, "plan": chosen, "plan_label": res.best.label() if res.best else None,
           "predicted_rank": pr, "measured_rank": mr, "top_choice_agrees": bool(names) and chosen == mr[0],
           "predicted_goodput": {n: round(predicted[n], 3) for n in names},
           "measured_goodput": {n: round(measured[n], 3) for n in names},
           "plan_choice_vs_measured_best": (round(measured[chosen] / best_meas, 3)
                                            if chosen in measured and best_meas else None),
           "plan_prediction_error": (round(predicted[chosen] / measured[chosen] - 1, 3)
                                     if chosen in measured and measured[chosen] else None),
           "detail": detail, "calibration": {k: _calib_summary(v) for k, v in calib.items()},
           "measured_from_earlier_run": sorted(n for n in names if a.measured_from
                                               and (Path(a.measured_from) / n / "measure.json").exists()),
           "wall_s": round(time.monotonic() - t_all, 1)}
    (out / "plan_validate.json").write_text(json.dumps(rec, indent=1))
    print(json.dumps(rec))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
