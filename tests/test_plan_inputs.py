"""The planner under odd input and the files it writes, as a user runs it: bad numbers and links are input errors
(exit 2), aliases of one chip on a host are one group, the launch file never asks for more context than an
instance's KV cache holds, and the table names the KV link the deployment uses."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dlmix.plan.analytic import SLO
from dlmix.plan.inventory import InventoryError, load_inventory
from dlmix.plan.report import launch_deployment, tables
from dlmix.plan.search import Candidate, GroupChoice, Planner, PlanResult
from dlmix.plan.workload import load_plan_workload
from dlmix.sim.config import load_model

DLMIX = [sys.executable, "-m", "dlmix.cli"]


# ---- dlmix plan recommends instances whose launch file max_model_len exceeds the instance's own KV capacity
INV1 = {"name": "rtx4090-1x4", "default_link": "rdma-100g",
       "hosts": [{"name": h, "chips": {"RTX4090": 1}} for h in "abcd"]}


def test_launch_max_model_len_fits_kv_cache():
    kv_bpt = 2 * 32 * 8 * 128 * 2
    cap_indep = int((0.9 * 24e9 - 8.03e9 * 2) / kv_bpt)
    assert cap_indep == 42266
    pl = Planner(load_inventory(INV1), load_model("llama-3.1-8b"), SLO(30.0, 0.2, 80.0),
                 load_plan_workload("mooncake", 300), None)
    res = pl.plan(top_k=2, refine=False)
    assert res.feasible
    assert [(c.chip, c.tp) for c in res.best.choices] == [("RTX4090", 1)]
    assert pl.cost.kv_capacity_tokens("RTX4090", 1) == cap_indep
    ld = launch_deployment(pl, res.best)
    for inst in ld["instances"]:
        assert inst["max_model_len"] <= cap_indep, (
            f"{inst['name']}: max_model_len {inst['max_model_len']} > the {cap_indep} KV tokens the planner itself "
            f"computes for 1x RTX4090: vLLM refuses to start this engine")


# ---- `dlmix plan --top-k 0` (or any value < 1) crashes with an IndexError traceback (exit 1) instead of a


def test_top_k_zero_is_an_input_error():
    r = subprocess.run([*DLMIX, "plan", "-i", "s4000x2", "-m", "smollm2", "-w",
                        "synthetic:groups=2,per_group=3,prefix=256,suffix=64,output=16", "-n", "6",
                        "--no-baselines", "--no-refine", "--top-k", "0"], capture_output=True, text=True, timeout=60)
    assert "Traceback" not in r.stderr + r.stdout and "IndexError" not in r.stderr + r.stdout, r.stderr[-800:]
    assert r.returncode == 2, r.returncode


# ---- non-finite numbers pass the planner's input checks. `--rate nan` / `--slo-ttft-ms nan` give "NO FEASIBLE
BASE = [*DLMIX, "plan", "-i", "s4000x2", "-m", "smollm2", "-w",
        "synthetic:groups=2,per_group=3,prefix=256,suffix=64,output=16", "-n", "6", "--no-baselines", "--no-refine"]


@pytest.mark.parametrize("extra", [["--rate", "nan"], ["--rate", "inf"], ["--slo-ttft-ms", "nan"]])
def test_non_finite_inputs_rejected(extra):
    r = subprocess.run(BASE + extra, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, (r.returncode, r.stdout.strip().splitlines()[-1][:300] if r.stdout.strip() else "")


def test_json_line_is_strict_json_for_nan_rate():
    r = subprocess.run(BASE + ["--rate", "nan"], capture_output=True, text=True, timeout=60)
    last = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else "{}"
    if last.startswith("{"):
        json.loads(last, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(f"non-JSON constant {c}")))


# ---- an inventory link with a negative (or zero) bandwidth is accepted; the planner then plans PD over it
@pytest.mark.parametrize("where", ["links", "host", "default_link"])
@pytest.mark.parametrize("link", [{"bandwidth_gbps": -100}, {"bandwidth_gbps": 0}, {"bandwidth_gbps": 100, "eff": -1},
                                  {"bandwidth_gbps": 100, "setup_ms": -5}])
def test_bad_link_figures_rejected(where, link):
    d = {"hosts": [{"name": "a", "chips": {"H100": 2}}, {"name": "b", "chips": {"H20": 2}}]}
    if where == "links":
        d["links"] = [{"hosts": ["a", "b"], "link": link}]
    elif where == "host":
        d["hosts"][0]["link"] = link
    else:
        d["default_link"] = link
    with pytest.raises(InventoryError):
        inv = load_inventory(d)
        lp = inv.catalog.link(inv.between("a", "b") if where != "host" else inv.between("a", "a"))
        print("accepted:", lp, "transfer of 1 MB takes", lp.transfer_time(1e6), "s")


# ---- one host listing the same chip under two catalog names (an alias, e.g. H100 and H100-SXM) becomes two
INV5 = {"hosts": [{"name": "a", "chips": {"H100": 2, "H100-SXM": 2}}]}


def test_alias_counts_merge_per_host():
    inv = load_inventory(INV5)
    g = inv.group("H100")
    assert g.count == 4
    assert g.instances(4) == 1, f"4 H100 on host a but instances(4) = {g.instances(4)}; per_host {g.per_host}"


def test_launch_has_every_planned_instance():
    inv = load_inventory(INV5)
    pl = Planner(inv, load_model("llama-3.1-8b"), SLO(5.0, 0.05, 90.0),
                 load_plan_workload("synthetic:groups=2,per_group=3,prefix=256,suffix=64,output=16", 6))
    c = Candidate((GroupChoice("H100", "both", 2, inv.group("H100").instances(2)),))
    ld = launch_deployment(pl, c)
    assert len(ld["instances"]) == c.choices[0].instances == 2, [i["devices"] for i in ld["instances"]]


# ---- the "Recommended deployment" table's KV link column shows the group's optimistic analytic link
def test_table_link_is_the_deployments_link():
    inv = load_inventory("h100x4_h20x4")
    pl = Planner(inv, load_model("llama-3.1-8b"), SLO(5.0, 0.05, 80.0), load_plan_workload("mooncake", 20))
    c = Candidate((GroupChoice("H100", "prefill", 1, 4), GroupChoice("H20", "prefill", 2, 1),
                   GroupChoice("H20", "decode", 2, 1)), goodput=8.0, summary={})
    dep = pl.deployment_dict(c)
    used = {(i["chip"], i["role"]): i["link"] for i in dep["instances"]}
    assert used[("H20", "prefill")] == "nvlink"
    r = PlanResult(True, c, [], [c], [c], [], 1, 0, 0.0, None, pl.slo, inv, pl.model, pl.wl)
    rec = tables(r)[0]
    rows = list(zip(*[col._cells for col in rec.columns]))
    shown = {(row[0], row[2]): row[6] for row in rows}
    for k, link in used.items():
        assert shown[k] == link, f"table says {k} uses {shown[k]}, deployment uses {link}"


def test_out_that_is_a_file_is_refused_before_planning(tmp_path):
    """``-o FILE`` (an existing file) ran the whole search and then died with FileExistsError (new-user review)."""
    f = tmp_path / "not_a_folder"
    f.write_text("x")
    r = subprocess.run(BASE + ["-o", str(f)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "not a folder" in r.stderr and "Traceback" not in r.stderr, r.stderr[-800:]


# ---- huge inputs hung `dlmix plan` (> 120 s): 100000000 chips on a host, a 1e9-token prefix, 1e8 groups; a typo
# now fails at once with the bound in the message (new-user review)
@pytest.mark.parametrize("inv,match", [
    ({"hosts": [{"name": "a", "chips": {"H100": 100_000_000}}]}, r"count of H100 must be in 1\.\.1024"),
    ({"hosts": [{"name": "a", "chips": {"H100": 1000, "H20": 1000}}]}, r"at most 1024 chips per host"),
    ({"hosts": [{"name": f"h{i}", "chips": {"H100": 1024}} for i in range(5)]}, r"at most 4096 chips in all"),
    ({"hosts": [{"name": f"h{i}", "chips": {"H100": 1}} for i in range(513)]}, r"at most 512 hosts"),
])
def test_inventory_bounds(inv, match):
    with pytest.raises(InventoryError, match=match):
        load_inventory(inv)


@pytest.mark.parametrize("spec,match", [
    ("prefix=1000000000", r"prefix must be in 0\.\.1048576"),
    ("groups=100000000", r"groups must be in 1\.\.100000"),
    ("groups=1000,per_group=1000", r"groups × per_group must be at most 100000"),
    ("prefix=1000000,suffix=100000", r"prefix \+ suffix must be in 1\.\.1048576"),
    ("output=0", r"output must be in 1\.\.1048576"),
    ("groups=2,groups=3", r"key 'groups' given more than once"),
])
def test_synthetic_workload_bounds_and_repeats(spec, match):
    from dlmix.sim.workload import WorkloadError

    with pytest.raises(WorkloadError, match=match):
        load_plan_workload("synthetic:" + spec, 6)


def test_huge_inventory_fails_at_once_on_the_cli(tmp_path):
    p = tmp_path / "inv.yaml"
    p.write_text("hosts:\n  - {name: a, chips: {H100: 100000000}}\n")
    r = subprocess.run([*DLMIX, "plan", "-i", str(p), "-w", "synthetic:groups=2,per_group=3,prefix=256,suffix=64",
                        "--no-baselines", "--no-refine"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "1..1024" in r.stderr and "Traceback" not in r.stderr, r.stderr[-800:]
    r = subprocess.run([*DLMIX, "plan", "-i", "s4000x2", "-m", "smollm2", "-w", "synthetic:prefix=1000000000",
                        "--no-baselines", "--no-refine"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "prefix must be in 0..1048576" in r.stderr, r.stderr[-800:]


def test_sim_reasons_show_numbers_that_differ():
    """The infeasible-plan reason read "TPOT 50.0 ms > 50.0 ms target" for a TPOT of 50.04 ms: the numbers are now
    printed with as many decimals as it takes to tell them apart."""
    inv = load_inventory("s4000x2")
    pl = Planner(inv, load_model("smollm2"), SLO(2.0, 0.05, 90.0),
                 load_plan_workload("synthetic:groups=2,per_group=3,prefix=256,suffix=64,output=16", 6))
    c = Candidate((GroupChoice("MTT-S4000", "both", 1, 2),),
                  summary={"ttft_ms": {"p90": 2000.3}, "tpot_ms": {"p90": 50.04}, "good_fraction": 0.5})
    msg = " ".join(pl.sim_reasons(c))
    assert "TPOT 50.04 ms > 50.00 ms" in msg and "2000.3 ms > 2000.0 ms" in msg, msg


# ---- review 4: non-finite numbers in a Mooncake trace. `"input_length": Infinity` (or in hash_ids) crashed `dlmix
# plan` / `dlmix sim` with an OverflowError traceback (exit 1); a NaN/Infinity timestamp was accepted and the plan
# answered "NO FEASIBLE DEPLOYMENT" (exit 3) for what is an input error (exit 2)
_REC = '{"timestamp": %s, "input_length": %s, "output_length": 10, "hash_ids": [%s]}\n'


@pytest.mark.parametrize("bad", [("0", "Infinity", "1"), ("0", "100", "Infinity"), ("NaN", "100", "1"),
                                 ("Infinity", "100", "1"), ("-Infinity", "100", "1")])
def test_trace_non_finite_numbers_are_input_errors(tmp_path, bad):
    from dlmix.sim.workload import WorkloadError

    p = tmp_path / "t.jsonl"
    p.write_text(_REC % ("1000", "100", "1") + _REC % bad + _REC % ("2000", "100", "2"))
    with pytest.raises(WorkloadError, match=r"t\.jsonl:2"):
        load_plan_workload(str(p), 6)


def test_trace_infinity_on_the_cli_is_exit_2(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text(_REC % ("0", "Infinity", "1") + _REC % ("1000", "100", "1"))
    r = subprocess.run([*DLMIX, "plan", "-i", "s4000x2", "-m", "smollm2", "-w", str(p), "--no-baselines",
                        "--no-refine"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr, (r.returncode, r.stderr[-800:])


# ---- review 4: `-i FOLDER` (or an unreadable/binary file) crashed with IsADirectoryError / UnicodeDecodeError
def test_inventory_that_is_a_folder_or_binary_is_an_input_error(tmp_path):
    with pytest.raises(InventoryError, match="cannot read inventory"):
        load_inventory(str(tmp_path))
    b = tmp_path / "inv.yaml"
    b.write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(InventoryError, match="cannot read inventory"):
        load_inventory(str(b))
    r = subprocess.run([*DLMIX, "plan", "-i", str(tmp_path), "-w", "synthetic", "--no-baselines", "--no-refine"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr, (r.returncode, r.stderr[-800:])


# ---- review 4: an --out folder that passes the early check but cannot be written (as root `-o /proc/x`; a full
# disk) crashed after the whole search with a FileNotFoundError/OSError traceback (exit 1) instead of exit 2
def test_out_write_failure_is_an_input_error_not_a_traceback(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    import dlmix.plan.report as report
    from dlmix.cli import app

    def boom(*a, **k):
        raise FileNotFoundError(2, "No such file or directory", str(tmp_path / "o"))

    monkeypatch.setattr(report, "write_outputs", boom)
    r = CliRunner().invoke(app, ["plan", "-i", "s4000x2", "-m", "smollm2", "-w",
                                 "synthetic:groups=2,per_group=3,prefix=256,suffix=64,output=16", "--no-baselines",
                                 "--no-refine", "--rate", "0.5", "-o", str(tmp_path / "o")])
    assert r.exit_code == 2 and not isinstance(r.exception, FileNotFoundError), (r.exit_code, repr(r.exception))


def test_a_sample_that_never_misses_the_slo_gives_a_goodput_marked_as_a_lower_bound():
    """An 8-request synthetic sample meets the SLO at every rate the search tries: the reported goodput (thousands of
    req/s for two chips) is where the search stopped, not a limit. Before, nothing said so (a newcomer read 46,991
    req/s for Llama-8B on 6 chips); now the candidate's note and the plan's notes say it is a lower bound."""
    r = subprocess.run([*DLMIX, "plan", "-i", "s4000x2", "-m", "smollm2", "-w",
                        "synthetic:groups=2,per_group=4,prefix=256,suffix=64,output=16", "--no-baselines",
                        "--no-refine"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-800:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["best"]["note"].startswith("goodput is a lower bound: the 8-request sample met the SLO at every rate")
    assert any(n.startswith("predicted goodput is a lower bound") for n in out["notes"]), out["notes"]


def test_requests_flag_does_not_apply_to_a_synthetic_workload():
    """docs/plan.md: a synthetic workload is always all its groups × per_group requests, ``--requests`` does not
    apply to it. Before, ``-n 1`` still refused the synthetic workload ("needs at least 2 requests, got 1"); a trace
    still needs ``n >= 2``."""
    wl = load_plan_workload("synthetic:groups=2,per_group=3,prefix=256,suffix=64,output=16", 1)
    assert len(wl.requests) == 6
    with pytest.raises(Exception, match="at least 2 requests, got 1"):
        load_plan_workload("mooncake", 1)


def test_lower_bound_note_of_a_synthetic_workload_names_its_own_size_not_n():
    """The lower-bound note tells the user how to get a larger sample: for a synthetic workload that is more
    groups × per_group, since -n is ignored there (before, it said "-n, or a longer trace" for every workload)."""
    pl = Planner(load_inventory("s4000x2"), load_model("smollm2"), SLO(2.0, 0.05, 90.0),
                 load_plan_workload("synthetic:groups=2,per_group=4,prefix=256,suffix=64,output=16", 300), None)
    res = pl.plan(top_k=1, pareto_points=0, refine=False)
    assert res.best.note.startswith("goodput is a lower bound: the 8-request sample"), res.best.note
    assert res.best.note.endswith("(a synthetic workload of more groups × per_group requests: -n does not apply "
                                  "to it)"), res.best.note


def test_launch_file_of_a_plan_with_extra_chips_names_the_chip_files(tmp_path):
    """docs/plan.md: add chips with ``--chips``; ``deploy_launch.yaml`` follows the ``dlmix launch`` schema. Before,
    the launch file of such a plan named the chip only, so ``dlmix launch FILE --check`` (which has no ``--chips``
    flag) refused it: "unknown chip 'X1' ... add it with --chips FILE". Now the plan writes ``router.chips``."""
    chips = tmp_path / "my_chips.yaml"
    chips.write_text("chips:\n  X1: {vendor: Acme, bf16_tflops: 400, mem_bw_gbps: 2000, mem_gb: 64, "
                     "confidence: low, source: test}\n")
    inv = tmp_path / "inv.yaml"
    inv.write_text("name: x1\nhosts:\n  - {name: a, chips: {X1: 2}}\n")
    out = tmp_path / "o"
    env = {k: v for k, v in __import__("os").environ.items() if k != "DLMIX_CHIPS"}
    r = subprocess.run([*DLMIX, "plan", "-i", str(inv), "--chips", str(chips), "-w",
                        "synthetic:groups=4,per_group=4,prefix=512,suffix=128,output=16", "--no-baselines",
                        "--no-refine", "-o", str(out)], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-800:]
    import yaml
    launch = yaml.safe_load((out / "deploy_launch.yaml").read_text())
    assert launch["router"]["chips"] == [str(chips.resolve())]
    assert {i["chip"] for i in launch["instances"]} == {"X1"}
    c = subprocess.run([*DLMIX, "launch", str(out / "deploy_launch.yaml"), "--check"], capture_output=True,
                       text=True, timeout=300, env=env)
    assert c.returncode == 0, c.stdout[-800:] + c.stderr[-800:]
    assert "ok (2 instance(s), router: yes)" in c.stdout + c.stderr


@pytest.mark.parametrize("where, spec", [
    ("host 'a': link", {"name": "x", "hosts": [{"name": "a", "chips": {"H100": 2}, "link": "nvlnk"}]}),
    ("links[0]", {"name": "x", "hosts": [{"name": "a", "chips": {"H100": 2}}, {"name": "b", "chips": {"H20": 2}}],
                  "links": [{"hosts": ["a", "b"], "link": "nvlnk"}]}),
    ("default_link", {"name": "x", "hosts": [{"name": "a", "chips": {"H100": 2}}], "default_link": "nvlnk"}),
])
def test_unknown_link_name_error_reads_without_quotes(where, spec):
    """An unknown link name in an inventory was reported as a quoted repr of the KeyError
    (`links[0]: "unknown link 'nvlnk'; known: ..."`); now it reads as the other inventory errors do."""
    with pytest.raises(InventoryError) as ei:
        load_inventory(spec)
    assert str(ei.value) == (f"<dict>: {where}: unknown link 'nvlnk'; known: local, nvlink, rdma-100g, rdma-400g, "
                             "tcp-10g, tcp-25g")


def test_infeasible_reason_names_the_slo_percentile_and_the_given_rate():
    """With ``--slo-pct 80`` the infeasible-plan reason read "simulated p90 ..." (the simulator's summaries hold
    p50/p90/p95/p99 only, and the reason fell back to p90: a p90 over the target does not show that the p80 is) and,
    with ``--rate``, "even at the lowest rate tried" for the one rate simulated. Now the plan's simulations also
    record the SLO's own percentile, and the reason names it and the given rate."""
    wl = load_plan_workload("synthetic:groups=2,per_group=10,prefix=256,suffix=64,output=16", 20)
    pl = Planner(load_inventory("s4000x2"), load_model("smollm2"), SLO(2.0, 0.05, 80.0), wl, 5.0)
    c = Candidate((GroupChoice("MTT-S4000", "both", 1, 2),))
    s = pl.simulate(c, 5.0)
    ttft_sorted = sorted(s["ttft_ms"][k] for k in ("p50", "p80", "p90"))
    assert ttft_sorted == [s["ttft_ms"]["p50"], s["ttft_ms"]["p80"], s["ttft_ms"]["p90"]]
    assert s["tpot_ms"]["p50"] <= s["tpot_ms"]["p80"] <= s["tpot_ms"]["p90"]
    c.summary = {"ttft_ms": {"p80": 2500.0, "p90": 9000.0}, "tpot_ms": {"p80": 40.0, "p90": 60.0},
                 "good_fraction": 0.7}
    msg = " ".join(pl.sim_reasons(c))
    assert msg.startswith("TTFT: simulated p80 2500 ms > 2000 ms target at the given rate"), msg
    assert "ITL" not in msg and "p90" not in msg and "lowest rate" not in msg, msg


def test_a_timing_profile_measured_with_other_engine_settings_is_noted():
    """docs/plan.md: the engine settings are to be set to what the calibration was measured with. The stored vLLM CPU
    profile was measured with --max-num-batched-tokens 2048 --max-num-seqs 64; planned with the defaults (8192, 256)
    nothing said that the simulated engine differs from the measured one. Now a note says so (and none when they
    agree)."""
    inv = load_inventory({"name": "cpu", "hosts": [{"name": "me", "chips": {"cpu-x86": 2}}],
                          "timing": {"cpu-x86": {1: "smollm2_vllm_cpu"}}})
    wl = load_plan_workload("synthetic:groups=2,per_group=3,prefix=256,suffix=64,output=16", 6)
    pl = Planner(inv, load_model("smollm2"), SLO(3.0, 0.1, 90.0), wl, None)
    assert pl.notes == ["timing of cpu-x86 size 1 (smollm2_vllm_cpu) was measured with max_num_batched_tokens 2048 "
                        "(plan: 8192, --max-num-batched-tokens), max_num_seqs 64 (plan: 256, --max-num-seqs): its "
                        "iteration times describe an engine run with the profile's settings; plan with them"]
    pl = Planner(inv, load_model("smollm2"), SLO(3.0, 0.1, 90.0), wl, None,
                 engine={"max_num_batched_tokens": 2048, "max_num_seqs": 64})
    assert pl.notes == []


def test_a_misspelt_workload_name_suggests_the_generator():
    """``-w synthetc`` (dlmix plan and dlmix sim): the error lists ``synthetic`` next to the built-in traces and
    suggests it; before, it named only the traces, so the generator a user meant did not appear."""
    from dlmix.sim.cli import build_workload
    from dlmix.sim.workload import WorkloadError

    for load in (lambda: load_plan_workload("synthetc", 10, 64), lambda: build_workload("synthetc")):
        with pytest.raises(WorkloadError) as e:
            load()
        assert "or synthetic); did you mean 'synthetic'?" in str(e.value)
    with pytest.raises(WorkloadError) as e:
        load_plan_workload("no-such-trace.jsonl", 10, 64)
    assert "did you mean" not in str(e.value) and "not found" in str(e.value)


def test_a_sub_second_ttft_target_is_stated_in_milliseconds():
    """``--slo-ttft-ms 1``: the infeasible reason read "takes 0.01 s to prefill ... > 0.00 s target"; a target under
    a second is now stated in milliseconds, both numbers in the same unit."""
    r = subprocess.run([*DLMIX, "plan", "-i", "h100x4_h20x4", "-w", "synthetic", "--slo-ttft-ms", "1"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 3, (r.returncode, r.stderr[-800:])
    reasons = json.loads(r.stdout.strip().splitlines()[-1])["reasons"]
    assert "ms to prefill on 4× H100 > 1 ms target" in reasons[0], reasons
    assert "0.00 s" not in reasons[0]
    assert "SLO TTFT 1 ms, ITL 50 ms" in r.stdout and "TTFT 0.001 s" not in r.stdout  # the report's title too
