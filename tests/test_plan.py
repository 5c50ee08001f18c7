"""dlmix plan: inventories, analytic pruning, the search on built-in inventories, deployment files, infeasible
plans, the Pareto front (fast: small workload samples, few simulated candidates)."""
from __future__ import annotations

import math

import pytest
import yaml

from dlmix.hw.cost import ModelSpec
from dlmix.plan.analytic import SLO, cluster_capacity, estimate_role
from dlmix.plan.inventory import InventoryError, builtin_inventories, load_inventory
from dlmix.plan.report import launch_deployment, result_dict, sim_deployment, write_outputs
from dlmix.plan.search import Candidate, GroupChoice, Planner, pareto_front
from dlmix.plan.workload import load_plan_workload
from dlmix.sim.config import load_deployment, load_model
from dlmix.sim.simulator import Simulator
from dlmix.sim.workload import WorkloadError

LLAMA = load_model("llama-3.1-8b")


@pytest.fixture(scope="module")
def wl():
    return load_plan_workload("mooncake", 120)


def test_builtin_inventories_load():
    names = builtin_inventories()
    assert {"h100x4_h20x4", "910bx8_h20x4", "mix32", "s4000x2"} <= set(names)
    inv = load_inventory("mix32")
    assert inv.total_chips == 32
    assert [g.chip for g in inv.groups] == ["Ascend910B", "K100", "C500", "MTT-S4000", "H20"]
    nvidia = [g for g in inv.groups if inv.catalog.chip(g.chip).vendor == "NVIDIA"]
    assert len(nvidia) == 1 and len(inv.groups) - 1 == 4
    g = inv.group("910B")  # alias
    assert g.tp_sizes() == [1, 2, 4, 8] and g.instances(4) == 2
    # the S4000 host has no link entry: TCP 25G (default) is its group's slowest link
    assert inv.group("MTT-S4000").link == "tcp-25g"
    assert load_inventory("h100x4_h20x4").group("H100").link == "rdma-100g"
    # a deployment's link per group: the slowest towards the groups it exchanges KV with
    assert inv.link_to("H20", ["Ascend910B", "K100"]) == "rdma-100g"
    assert inv.link_to("H20", ["Ascend910B", "MTT-S4000"]) == "tcp-25g"
    assert inv.link_to("H20", []) == "nvlink"


def test_inventory_errors(tmp_path):
    with pytest.raises(InventoryError, match="unknown chip 'Z9000'"):
        load_inventory({"hosts": [{"name": "a", "chips": {"Z9000": 2}}]})
    with pytest.raises(InventoryError, match="unknown host 'b'"):
        load_inventory({"hosts": [{"name": "a", "chips": {"H100": 2}}], "links": [{"hosts": ["a", "b"],
                                                                                    "link": "rdma-100g"}]})
    with pytest.raises(InventoryError, match="count of H100 must be >= 1"):
        load_inventory({"hosts": [{"name": "a", "chips": {"H100": 0}}]})
    with pytest.raises(InventoryError, match="unknown key"):
        load_inventory({"hosts": [{"name": "a", "chips": {"H100": 1}, "gpus": 3}]})
    with pytest.raises(InventoryError, match="not found"):
        load_inventory(str(tmp_path / "nope.yaml"))
    with pytest.raises(InventoryError, match="duplicate host"):
        load_inventory({"hosts": [{"name": "a", "chips": {"H100": 1}}, {"name": "a", "chips": {"H20": 1}}]})


def test_workload_sample_and_rate(wl):
    reqs = wl.at(2.0)
    assert len(reqs) == 120
    assert (len(reqs) - 1) / (reqs[-1].arrival - reqs[0].arrival) == pytest.approx(2.0)
    assert [r.input_len for r in reqs] == list(wl.input_len)
    syn = load_plan_workload("synthetic:groups=3,per_group=4,prefix=1024,suffix=100,output=16")
    assert len(syn.requests) == 12 and set(syn.input_len) == {1124}
    assert syn.hit.max() == 1024  # the shared prefix's two 512-token blocks
    assert {r.trace_block for r in syn.requests} == {32}  # gcd(64, 32, 128)
    # a 300-token prefix: hits of whole hash blocks of gcd(block size, 32, 128) tokens (512-token ids saw none)
    for bs, tb in ((64, 32), (16, 16), (48, 16), (128, 32)):
        s = load_plan_workload("synthetic:groups=2,per_group=3,prefix=300,suffix=50,output=8", block_size=bs)
        assert {r.trace_block for r in s.requests} == {tb}
        assert s.hit.max() == 300 // tb * tb and sorted(s.hit)[:2] == [0, 0]  # each group's first request: no hit
    with pytest.raises(WorkloadError, match="unknown key 'grups'"):
        load_plan_workload("synthetic:grups=3")
    with pytest.raises(ValueError):
        wl.at(0)


def test_cluster_capacity_values():
    # prefill-bound PD: 2 req/s of prefill, 3 req/s of decode
    lam, why = cluster_capacity([(2.0, math.inf, 1)], [(3.0, 1)], [])
    assert lam == pytest.approx(2.0, rel=1e-4) and why == "prefill"
    # aggregated only: two instances with p = d = 1 split their time in half: 0.5 req/s each
    lam, why = cluster_capacity([], [], [(1.0, 1.0, 2)])
    assert lam == pytest.approx(1.0, rel=1e-4)
    # transfer-limited prefill: 0.5 req/s of link, plenty of compute
    lam, why = cluster_capacity([(4.0, 0.5, 1)], [(3.0, 1)], [])
    assert lam == pytest.approx(0.5, rel=1e-4) and why == "kv-transfer"
    assert cluster_capacity([(1.0, math.inf, 1)], [], []) == (0.0, "none")


def test_estimate_role_memory_and_slo(wl):
    from dlmix.hw.cost import CostModel

    big = ModelSpec(70e9, 80, 64, 8, 128, 2, "big-70b")
    cost = CostModel(big)
    e = estimate_role(cost, wl, SLO(5, 0.05, 80), "RTX4090", 1, "both")
    assert not e.ok and e.reason.startswith("memory") and "140.0 GB" in e.reason
    cost = CostModel(LLAMA)
    e = estimate_role(cost, wl, SLO(5, 0.05, 80), "H100", 1, "decode")
    assert e.ok and e.d > 0 and e.p == 0
    e = estimate_role(cost, wl, SLO(5, 0.005, 80), "MTT-S4000", 1, "decode")
    assert not e.ok and e.reason.startswith("ITL")


@pytest.fixture(scope="module")
def small_plan(wl):
    pl = Planner(load_inventory("h100x4_h20x4"), LLAMA, SLO(5.0, 0.05, 80), wl)
    return pl, pl.plan(top_k=2, pareto_points=1, refine=False)


def test_plan_small_inventory(small_plan, tmp_path):
    pl, r = small_plan
    assert r.feasible and r.best is not None and r.best.goodput > 0
    assert r.best.summary["good_fraction"] >= 0.8
    assert r.sims > 0 and r.analytic_count > 0
    # the simulated goodput is the best of the simulated candidates
    assert r.best.goodput == max(c.goodput or 0 for c in r.simulated)
    # deployment file: dlmix sim loads it as it is and runs it
    paths = write_outputs(pl, r, tmp_path)
    names = {p.name for p in paths}
    assert {"plan.json", "deploy_sim.yaml", "deploy_launch.yaml"} <= names
    dep = load_deployment(str(tmp_path / "deploy_sim.yaml"))
    # the file records the SLO it was planned for (SLO(5.0, 0.05, 80)): dlmix sim judges against it by default
    assert (dep.slo_ttft, dep.slo_itl, dep.slo_pct) == (5.0, 0.05, 80.0)
    used = [c for c in r.best.choices if c.role != "unused"]
    assert len(dep.instances) == sum(c.instances for c in used)
    assert {(i.chip, i.role, i.num_chips) for i in dep.instances} == {(c.chip, c.role, c.tp) for c in used}
    s = Simulator(dep, LLAMA, r.best.policy, policy_params=pl.policy_params(r.best)).run(
        pl.wl.at(r.best.goodput), 5.0, 0.05).summary
    assert s["good_fraction"] == pytest.approx(r.best.summary["good_fraction"])
    # dlmix launch's schema accepts the launch file
    from dlmix.launch.config import Deployment as LaunchDeployment

    ld = LaunchDeployment.from_file(tmp_path / "deploy_launch.yaml")
    assert len(ld.instances) == len(dep.instances)
    assert {i.device for i in ld.instances} == {"cuda"}
    assert ld.router.policy == r.best.policy
    d = result_dict(r)
    assert d["best"]["goodput_req_s"] == pytest.approx(r.best.goodput, rel=1e-3)


def test_pareto_front_monotone(small_plan):
    _, r = small_plan
    f = r.pareto
    assert f and f[-1].goodput == max(c.goodput or 0 for c in r.simulated)
    for a, b in zip(f, f[1:]):
        assert a.chips_used < b.chips_used and a.goodput < b.goodput
    mk = lambda n, g: Candidate((GroupChoice("H100", "both", 1, n),), goodput=g)  # noqa: E731
    front = pareto_front([mk(4, 3.0), mk(2, 2.0), mk(3, 1.5), mk(4, 2.5), mk(1, 0.0), mk(5, 3.0), mk(6, None)])
    assert [(c.chips_used, c.goodput) for c in front] == [(2, 2.0), (4, 3.0)]


def test_infeasible_plan_names_binding_constraint(wl):
    inv = load_inventory("s4000x2")
    r = Planner(inv, LLAMA, SLO(2.0, 0.025, 90), wl).plan()
    assert not r.feasible and r.best is None
    assert len(r.reasons) == 1 and "prefill" in r.reasons[0] and "TTFT" in r.reasons[0]
    assert "MTT-S4000" in r.reasons[0]
    r = Planner(inv, LLAMA, SLO(60.0, 0.004, 90), wl).plan()
    assert not r.feasible and any(x.startswith("no chip group can decode") and "ITL" in x for x in r.reasons)


def test_sim_deployment_text_and_blind_router_chip(small_plan):
    pl, r = small_plan
    c = Candidate((GroupChoice("H100", "prefill", 1, 4), GroupChoice("H20", "decode", 1, 4)), router_chip="H100")
    d = yaml.safe_load(sim_deployment(pl, c))
    assert all(g["router_chip"] == "H100" for g in d["instances"])
    dep = load_deployment(d)
    assert sum(1 for i in dep.instances if i.role == "decode") == 4
    ld = launch_deployment(pl, c)
    assert [i["devices"] for i in ld["instances"]] == ["0", "1", "2", "3"] * 2


def test_cli_infeasible_and_plan(tmp_path):
    import json

    from typer.testing import CliRunner

    from dlmix.cli import app

    res = CliRunner().invoke(app, ["plan", "-i", "s4000x2", "--slo-ttft-ms", "2000", "-n", "60"])
    assert res.exit_code == 3, res.output
    assert "NO FEASIBLE DEPLOYMENT" in res.output and "binding" in res.output
    res = CliRunner().invoke(app, ["plan", "-i", "h100x4_h20x4", "-n", "60", "--slo-ttft-ms", "5000", "--slo-pct",
                                   "80", "--top-k", "1", "--no-refine", "--no-baselines", "-o", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "deploy_sim.yaml").exists()
    # SLO round trip with the plan's default --slo-itl-ms (50 ms, where dlmix sim's own default is 25 ms): the file
    # records TTFT 5000 ms / ITL 50 ms / p80, and `dlmix sim -d deploy_sim.yaml` without --slo-* judges against them
    dep = load_deployment(str(tmp_path / "deploy_sim.yaml"))
    assert (dep.slo_ttft, dep.slo_itl, dep.slo_pct) == (5.0, 0.05, 80.0)
    assert yaml.safe_load((tmp_path / "deploy_sim.yaml").read_text())["slo"] == {"ttft_ms": 5000.0, "itl_ms": 50.0,
                                                                                 "pct": 80.0}
    res = CliRunner().invoke(app, ["sim", "-d", str(tmp_path / "deploy_sim.yaml"), "-w", "mooncake", "--limit", "20"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output.strip().splitlines()[-1])[0]["goodput_targets_ms"] == {"ttft": 5000.0, "tpot": 50.0}
    res = CliRunner().invoke(app, ["sim", "-d", str(tmp_path / "deploy_sim.yaml"), "-w", "mooncake", "--limit", "20",
                                   "--slo-itl-ms", "25"])
    assert json.loads(res.output.strip().splitlines()[-1])[0]["goodput_targets_ms"] == {"ttft": 5000.0, "tpot": 25.0}
    res = CliRunner().invoke(app, ["plan", "-i", "nope", "-n", "60"])
    assert res.exit_code == 2 and "not found" in res.output
    res = CliRunner().invoke(app, ["plan", "-i", "h100x4_h20x4", "--rate", "fast"])
    assert res.exit_code == 2 and "--rate: a request rate in req/s or 'maximise' is expected, got 'fast'" in res.output
    for args, msg in ((["--rate", "0"], "--rate must be a positive finite number, got 0"),
                      (["--slo-ttft-ms", "-5"], "--slo-ttft-ms must be a positive finite number, got -5"),
                      (["--slo-pct", "101"], "--slo-pct must be in (0, 100], got 101"),
                      (["--top-k", "0"], "--top-k must be at least 1, got 0"),
                      (["-m", "nope"], "unknown model 'nope'; presets: llama-3.1-8b")):
        res = CliRunner().invoke(app, ["plan", "-i", "h100x4_h20x4", "-n", "20", *args])
        assert res.exit_code == 2 and f"error: {msg}" in res.output, (args, res.output)
    assert "(also smollm2, " in res.output
    # CPU chips run vLLM CPU, whose KV block size is a multiple of 32: a plan at 16 would write a launch file that
    # `dlmix launch` refuses, so the plan is refused with the reason instead
    inv = tmp_path / "cpus.yaml"
    inv.write_text(yaml.safe_dump({"name": "cpus", "hosts": [{"name": "a", "chips": {"cpu-x86": 2}}]}))
    res = CliRunner().invoke(app, ["plan", "-i", str(inv), "-m", "smollm2", "-n", "20", "--block-size", "16"])
    assert res.exit_code == 2 and "--block-size 16: the CPU chip type(s) cpu-x86 run vLLM CPU" in res.output, \
        res.output
    # a block no chip can hold blames the block size, not the weights (before: "weights do not fit on 1x H100")
    res = CliRunner().invoke(app, ["plan", "-i", "h100x4_h20x4", "-n", "20", "--block-size", "99999999"])
    assert res.exit_code == 2 and "one KV block of 99999999 tokens" in res.output and "weights do not" not in \
        res.output, res.output


def test_plan_for_a_fixed_rate_prefers_fewer_chips(wl):
    pl = Planner(load_inventory("h100x4_h20x4"), LLAMA, SLO(5.0, 0.05, 80), wl, rate=0.5)
    r = pl.plan(top_k=3, pareto_points=2, refine=False)
    assert r.feasible and r.rate == 0.5
    ok = [c for c in r.simulated if (c.goodput or 0) > 0]
    assert all(c.summary["good_fraction"] >= 0.8 for c in ok)
    assert r.best.chips_used == min(c.chips_used for c in ok)
    assert r.best.goodput == pytest.approx(r.best.summary["request_goodput"])
    with pytest.raises(ValueError, match="rate must be > 0"):
        Planner(load_inventory("h100x4_h20x4"), LLAMA, SLO(5.0, 0.05, 80), wl, rate=-1)


def test_baselines_structure_and_ratios(small_plan):
    from dlmix.plan.baselines import baselines, ratios

    pl, r = small_plan
    base = baselines(pl)
    assert {"homog_H100", "homog_H20", "homog_best", "homog_sum", "all_aggregated", "blind_pd",
            "blind_pd_reversed"} <= set(base)
    assert all(ch.role == "both" for ch in base["all_aggregated"].choices)
    assert base["all_aggregated"].chips_used == 8
    b = base["blind_pd"]
    assert [(ch.chip, ch.role) for ch in b.choices] == [("H100", "prefill"), ("H20", "decode")]
    assert b.router_chip == "H100"
    assert [(ch.chip, ch.role) for ch in base["blind_pd_reversed"].choices] == [("H20", "prefill"),
                                                                                  ("H100", "decode")]
    assert base["homog_best"].goodput == max(base[k].goodput for k in ("homog_H100", "homog_H20"))
    assert base["homog_sum"].goodput == pytest.approx(base["homog_H100"].goodput + base["homog_H20"].goodput)
    rt = ratios(r.best.goodput, base)
    for k, c in base.items():
        v = rt[f"plan_vs_{k}"]
        assert v is None if not c.goodput else v == pytest.approx(r.best.goodput / c.goodput, abs=1e-3)


def _cpu_inventory(tmp_path, calib):
    """Two cores of one CPU, each size with its own measured timing (a copy of the stored vLLM CPU profile)."""
    import json

    (tmp_path / "calib_1.json").write_text(json.dumps(calib(2.0)))
    (tmp_path / "calib_2.json").write_text(json.dumps(calib(1.0)))
    p = tmp_path / "inv.yaml"
    p.write_text(yaml.safe_dump({"name": "cpu2", "hosts": [{"name": "local", "chips": {"cpu-x86": 2}}],
                                 "timing": {"cpu-x86": {1: "calib_1.json", 2: "calib_2.json"}}}))
    return load_inventory(str(p))


@pytest.fixture
def calib():
    import json
    from importlib import resources

    base = json.loads(resources.files("dlmix").joinpath("data/sim_calib_smollm2_vllm_cpu.json").read_text())

    def make(slow: float) -> dict:
        c = {k: v * slow for k, v in base["coefficients"].items()}
        return {"name": f"x{slow:g}", "coefficients": c}
    return make


def test_measured_timing_replaces_the_roofline(tmp_path, calib):
    from dlmix.sim.timing import LinearTiming

    inv = _cpu_inventory(tmp_path, calib)
    g = inv.group("cpu")
    assert g.tp_sizes() == [1, 2]
    assert g.timing_profile(1) == str(tmp_path / "calib_1.json") and g.timing_profile(4) is None
    wl = load_plan_workload("synthetic:groups=2,per_group=4,prefix=512,suffix=128,output=64", 8)
    slo = SLO(1.5, 0.06, 90)
    pl = Planner(inv, load_model("smollm2"), slo, wl, engine={"max_num_batched_tokens": 2048, "max_num_seqs": 64})
    t1 = LinearTiming.load(g.timing_profile(1))
    e = pl.estimate("cpu-x86", 1, "both")
    # TTFT of each request from the measured coefficients: r0 + c0 + c_tok·(N − h) + c_quad·(N² − h²)
    n = wl.input_len.astype(float)
    h = wl.hit.astype(float)
    pre = t1.r0 + t1.c0 + t1.c_tok * (n - h) + t1.c_quad * (n * n - h * h)
    assert e.p == pytest.approx(0.8 / pre.mean())
    assert e.figures["itl_1_s"] == pytest.approx(t1.c0 + t1.c_seq + t1.c_ctx * (n.mean() + 32))
    # the 2-core profile is twice as fast: twice the prefill capacity
    assert pl.estimate("cpu-x86", 2, "both").p == pytest.approx(2 * e.p)
    # each simulated instance gets its size's profile; the engine settings are the planner's
    c = Candidate((GroupChoice("cpu-x86", "both", 1, 2),))
    d = pl.deployment_dict(c)
    assert d["max_num_batched_tokens"] == 2048 and d["max_num_seqs"] == 64
    assert d["instances"][0]["timing"] == str(tmp_path / "calib_1.json")
    with pytest.raises(ValueError, match="unknown engine setting"):
        Planner(inv, load_model("smollm2"), slo, wl, engine={"max_batch": 3})
    # any block size of at least one token (the simulator keys blocks that do not divide the hash block, too)
    assert Planner(inv, load_model("smollm2"), slo, wl, block_size=48).block_size == 48
    with pytest.raises(ValueError, match="block_size must be >= 1 token, got 0"):
        Planner(inv, load_model("smollm2"), slo, wl, block_size=0)


def test_timing_errors(tmp_path):
    bad = {"name": "x", "hosts": [{"name": "a", "chips": {"cpu-x86": 2}}], "timing": {"cpu-x86": {4: "smollm2_vllm_cpu"}}}
    with pytest.raises(InventoryError, match="no host holds an instance of 4"):
        load_inventory(bad)
    bad["timing"] = {"cpu-x86": {1: "no_such_profile"}}
    with pytest.raises(InventoryError, match="not found"):
        load_inventory(bad)
    bad["timing"] = {"H100": {1: "smollm2_vllm_cpu"}}
    with pytest.raises(InventoryError, match="no H100 on any host"):
        load_inventory(bad)


def test_pd_inside_one_chip_group(tmp_path, calib):
    """Two cores of one type: 1 prefill + 1 decode is searched beside the aggregated options, simulated, and written
    as a launch file with one engine per core."""
    inv = _cpu_inventory(tmp_path, calib)
    wl = load_plan_workload("synthetic:groups=2,per_group=8,prefix=512,suffix=128,output=64", 16)
    pl = Planner(inv, load_model("smollm2"), SLO(1.5, 0.06, 90), wl,
                 engine={"max_num_batched_tokens": 2048, "max_num_seqs": 64})
    splits = pl.split_options(inv.group("cpu-x86"))
    assert splits == [(GroupChoice("cpu-x86", "prefill", 1, 1), GroupChoice("cpu-x86", "decode", 1, 1))]
    labels = {c.label() for c in pl.enumerate()}
    assert labels == {"cpu-x86 B tp1×2 [cost, bs64]", "cpu-x86 B tp2×1 [cost, bs64]",
                      "cpu-x86 P tp1×1 | cpu-x86 D tp1×1 [cost, bs64]"}
    pd = next(c for c in pl.enumerate() if len(c.choices) == 2)
    pl.evaluate(pd)
    assert pd.goodput > 0 and pd.summary["good_fraction"] >= 0.9
    dep = pl.deployment_dict(pd)
    assert [(i["role"], i["count"], i["timing"]) for i in dep["instances"]] == [
        ("prefill", 1, str(tmp_path / "calib_1.json")), ("decode", 1, str(tmp_path / "calib_1.json"))]
    ld = launch_deployment(pl, pd)
    assert [(i["role"], i["cpus"], i["tensor_parallel_size"]) for i in ld["instances"]] == [
        ("prefill", "0", 1), ("decode", "1", 1)]
    agg = launch_deployment(pl, Candidate((GroupChoice("cpu-x86", "both", 2, 1),)))
    assert [(i["cpus"], i["tensor_parallel_size"]) for i in agg["instances"]] == [("0-1", 1)]
    from dlmix.launch.config import Deployment as LaunchDeployment

    p = tmp_path / "launch.yaml"
    p.write_text(yaml.safe_dump(ld))
    assert [i.role for i in LaunchDeployment.from_file(p).instances] == ["prefill", "decode"]


def test_split_devices_do_not_overlap():
    """PD inside a group spread over two hosts: the decode part takes the devices the prefill part left."""
    inv = load_inventory({"name": "x", "hosts": [{"name": "a", "chips": {"H100": 4}}, {"name": "b", "chips": {"H100": 4}}]})
    wl = load_plan_workload("mooncake", 40)
    pl = Planner(inv, LLAMA, SLO(5.0, 0.05, 80), wl)
    c = Candidate((GroupChoice("H100", "prefill", 1, 5), GroupChoice("H100", "decode", 1, 3)))
    ld = launch_deployment(pl, c)
    got = sorted((i["name"].split("-")[0], i["devices"]) for i in ld["instances"])
    assert got == [("a", "0"), ("a", "1"), ("a", "2"), ("a", "3"), ("b", "0"), ("b", "1"), ("b", "2"), ("b", "3")]
    assert [i["role"] for i in ld["instances"]].count("prefill") == 5


def test_launch_file_carries_the_simulated_engine_settings(tmp_path, calib):
    inv = _cpu_inventory(tmp_path, calib)
    wl = load_plan_workload("synthetic:groups=2,per_group=4,prefix=512,suffix=128,output=64", 8)
    pl = Planner(inv, load_model("smollm2"), SLO(1.5, 0.06, 90), wl,
                 engine={"max_num_batched_tokens": 2048, "max_num_seqs": 64})
    ld = launch_deployment(pl, Candidate((GroupChoice("cpu-x86", "both", 1, 2),)))
    assert [i["extra_args"] for i in ld["instances"]] == [
        ["--max-num-batched-tokens", "2048", "--max-num-seqs", "64"]] * 2


# ---------------------------------------------------------------------- the model's head counts and context limit
def test_allowed_tp_sizes_and_context_limit_of_real_configs(smollm2_dir, tiny_model_dir):
    """vLLM's rule (heads % TP == 0; KV heads % TP == 0, or TP % KV heads == 0 when TP > KV heads) on the configs
    dlmix builds, the presets and two made-up shapes; the context limit as vLLM derives it from config.json."""
    from dlmix.hw.cost import PRESETS, context_limit

    s = ModelSpec.from_hf_config(smollm2_dir)
    assert (s.q_heads, s.kv_heads, s.max_model_len) == (9, 3, 8192)
    assert s.allowed_tp_sizes() == [1, 3, 9]
    t = ModelSpec.from_hf_config(tiny_model_dir)
    assert (t.q_heads, t.kv_heads, t.max_model_len) == (4, 2, 4096)
    assert t.allowed_tp_sizes() == [1, 2, 4]
    assert load_model("smollm2").allowed_tp_sizes() == [1, 3, 9] and load_model("smollm2").max_model_len == 8192
    assert PRESETS["llama-3.1-8b"].allowed_tp_sizes() == [1, 2, 4, 8, 16, 32]
    assert PRESETS["qwen2.5-7b"].allowed_tp_sizes() == [1, 2, 4, 28]  # 28 heads, 4 KV heads: 7 and 14 split neither
    assert ModelSpec(1e9, 2, 12, 4, 64).allowed_tp_sizes() == [1, 2, 4, 12]
    assert ModelSpec(1e9, 2, 8, 1, 64).allowed_tp_sizes() == [1, 2, 4, 8]  # one KV head: replicated on every rank
    with pytest.raises(ValueError, match="head counts must be >= 1"):
        ModelSpec(1e9, 2, 0, 0, 64).allowed_tp_sizes()
    assert context_limit({"max_position_embeddings": 8192, "seq_length": 4096}) == 4096  # the smallest key
    assert context_limit({"max_position_embeddings": 4096, "rope_scaling": {"type": "linear", "factor": 2.0}}) == 8192
    llama31 = {"max_position_embeddings": 131072, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}
    assert context_limit(llama31) == 131072  # already scaled: not multiplied again
    assert context_limit({"hidden_size": 8}) == 0


def _long_prompt_trace(path, n: int = 40, every: int = 10) -> int:
    """A Mooncake-format trace of ``n`` requests, one in ``every`` with a 120k-token prompt; returns how many."""
    import json

    with open(path, "w") as f:
        for i in range(n):
            inp = 120000 if i % every == 3 else 1000 + 50 * i
            f.write(json.dumps({"timestamp": 250 * i, "input_length": inp, "output_length": 64,
                                "hash_ids": list(range(1000 * i, 1000 * i + (inp + 511) // 512))}) + "\n")
    return sum(1 for i in range(n) if i % every == 3)


def test_plan_never_emits_a_tp_or_context_the_model_cannot_run(tmp_path, smollm2_dir):
    """The issue's run: SmolLM2 (9 heads, 3 KV heads, 8192-token context) on H100 + H20 + L20 for a trace with 120k
    prompts at 4 req/s. Only TP 1 of the powers of two fits the heads: no candidate, baseline or launch instance uses
    another; the long requests are counted, reported and left out; max_model_len stays <= 8192; the launch file
    passes `dlmix launch --check`. With the model given as a config.json path, the report names its folder."""
    import json
    import shutil

    from typer.testing import CliRunner

    from dlmix.cli import app

    inv = tmp_path / "inv.yaml"
    inv.write_text(yaml.safe_dump({
        "name": "my-cluster",
        "hosts": [{"name": "node-a", "chips": {"H100": 4}, "link": "nvlink"},
                  {"name": "node-b", "chips": {"H20": 4, "L20": 2}}],
        "links": [{"hosts": ["node-a", "node-b"], "link": "rdma-100g"}], "default_link": "tcp-25g"}))
    trace = tmp_path / "trace.jsonl"
    n_long = _long_prompt_trace(trace)
    out = tmp_path / "out2"
    res = CliRunner().invoke(app, ["plan", "-i", str(inv), "-m", "smollm2", "-w", str(trace), "--rate", "4",
                                   "-n", "40", "--top-k", "2", "-o", str(out)])
    assert res.exit_code == 0, res.output
    rec = json.loads(res.output.strip().splitlines()[-1])
    assert (n_long, rec["requests_excluded"], rec["requests"], rec["model_max_len"]) == (4, 4, 36, 8192)
    assert rec["notes"] == [
        "TP sizes excluded (H100: 2, 4; H20: 2, 4; L20: 2): smollm2-135m has 9 attention heads and 3 KV heads; "
        "vLLM and SGLang run it at TP 1, 3, 9 only",
        "4 of 40 requests of the sample need more than the context limit of smollm2-135m (8192 tokens, prompt + "
        "output; the longest needs 120064): no deployment can serve them (vLLM rejects them), so they are left out "
        "of the estimates and simulations"]
    assert "note: TP sizes excluded (H100: 2, 4; H20: 2, 4; L20: 2)" in res.output
    plan = json.loads((out / "plan.json").read_text())
    tps = {g["tp"] for c in plan["simulated"] + list(plan["baselines"].values())
           for g in c["groups"] if g["role"] != "unused"}
    assert tps == {1}
    ld = yaml.safe_load((out / "deploy_launch.yaml").read_text())
    assert ld["model"] == "smollm2" and ld["instances"]
    assert {i["tensor_parallel_size"] for i in ld["instances"]} == {1}
    assert {i["max_model_len"] for i in ld["instances"]} == {4096}  # the power of two covering 1000+50*39+64 tokens
    res = CliRunner().invoke(app, ["launch", str(out / "deploy_launch.yaml"), "--check"])
    assert res.exit_code == 0 and ": ok (" in res.output, res.output
    # the model as a config.json path: named by its folder in the title, the launch file names the folder
    folder = tmp_path / "SmolLM2-copy"
    folder.mkdir()
    shutil.copy(smollm2_dir / "config.json", folder / "config.json")
    out3 = tmp_path / "out3"
    res = CliRunner().invoke(app, ["plan", "-i", str(inv), "-m", str(folder / "config.json"), "-w", str(trace),
                                   "--rate", "4", "-n", "40", "--top-k", "1", "--no-refine", "--no-baselines",
                                   "-o", str(out3)])
    assert res.exit_code == 0, res.output
    assert "— my-cluster (10 chips) | SmolLM2-copy | " in " ".join(res.output.split())
    assert json.loads(res.output.strip().splitlines()[-1])["model"] == "SmolLM2-copy"
    ld = yaml.safe_load((out3 / "deploy_launch.yaml").read_text())
    assert ld["model"] == str(folder) and {i["tensor_parallel_size"] for i in ld["instances"]} == {1}


def test_plan_caps_max_model_len_at_the_context_limit_and_refuses_a_workload_beyond_it(tmp_path):
    """A model whose limit (12000 tokens) is not a power of two: the launch file's max_model_len is the limit, not
    16384; a workload whose every request exceeds the limit is an input error naming the limit."""
    from dataclasses import replace

    wl = load_plan_workload("synthetic:groups=2,per_group=4,prefix=9000,suffix=1200,output=128", 8)  # 10328 tokens
    m = replace(LLAMA, max_model_len=12000)
    inv = load_inventory("h100x4_h20x4")
    pl = Planner(inv, m, SLO(5.0, 0.05, 80), wl)
    assert pl.excluded_requests == 0 and pl.notes == []
    ld = launch_deployment(pl, Candidate((GroupChoice("H100", "both", 1, 4),)))
    assert {i["max_model_len"] for i in ld["instances"]} == {12000}
    with pytest.raises(WorkloadError, match="8 of 8 requests need more than the model's 4096-token context"):
        Planner(inv, replace(LLAMA, max_model_len=4096), SLO(5.0, 0.05, 80), wl)


def test_title_never_splits_a_workload_setting(small_plan):
    """The mix32 example's synthetic workload in a narrow table title wraps between key=value pairs, not inside."""
    import io
    from dataclasses import replace

    from rich.console import Console

    from dlmix.plan.report import tables

    _, r = small_plan
    name = "synthetic:groups=16,per_group=16,prefix=6144,suffix=1200,output=128"
    con = Console(width=60, record=True, file=io.StringIO())  # the table squeezed below the name's width
    for t in tables(replace(r, workload=replace(r.workload, name=name))):
        con.print(t)
    text = con.export_text()
    for kv in name.split(":", 1)[1].split(","):
        assert any(kv in line for line in text.splitlines()), (kv, text[:600])


def test_timing_paths_of_an_inventory_named_relatively_are_absolute(tmp_path, calib, monkeypatch):
    """``dlmix plan -i inv/cpu.yaml`` wrote ``timing: inv/calib_1.json`` into deploy_sim.yaml: relative to the
    directory the plan ran in, so ``dlmix sim -d out/deploy_sim.yaml`` from anywhere else failed (new-user review)."""
    (tmp_path / "inv").mkdir()
    _cpu_inventory(tmp_path / "inv", calib)
    monkeypatch.chdir(tmp_path)
    g = load_inventory("inv/inv.yaml").group("cpu")
    assert g.timing_profile(1) == str(tmp_path / "inv" / "calib_1.json")
