"""Simulator mechanics on tiny hand-made workloads: KV cache LRU, exact prefix hits, batching, chunked prefill,
PD transfer time, determinism, input errors."""
import math

import pytest

from dlmix.sim.config import ConfigError, load_deployment
from dlmix.sim.engine import KVCache
from dlmix.sim.simulator import Simulator
from dlmix.sim.timing import LinearTiming
from dlmix.sim.workload import SimRequest, WorkloadError, ideal_reuse, load_trace, shared_prefix

LIN = {"c0": 0.01, "c_tok": 0.001, "c_quad": 0.0, "c_seq": 0.002, "c_ctx": 0.0, "r0": 0.0}


def _calib(tmp_path, **over):
    import json

    c = dict(LIN, **over)
    p = tmp_path / "lin.json"
    p.write_text(json.dumps({"name": "lin", "coefficients": c}))
    return str(p)


def _dep(tmp_path, blocks=1000, budget=8192, bs=64, **over):
    return {"name": "t", "block_size": bs, "max_num_batched_tokens": budget,
            "instances": [{"chip": "cpu-x86", "count": 1, "timing": _calib(tmp_path, **over),
                           "num_gpu_blocks": blocks}]}


def R(rid, t, n, out, ids):
    return SimRequest(rid, t, n, out, ids)


def test_kvcache_lru_eviction_and_events():
    stored, removed = [], []
    kv = KVCache(4, 16, stored.extend, removed.extend)
    assert kv.try_admit([1, 2, 3], 0, 3)
    assert kv.register([1, 2, 3]) == 3 and stored == [1, 2, 3]
    kv.release([1, 2, 3], 0)                       # tail first into the LRU: 3, 2, 1
    assert list(kv.lru) == [3, 2, 1] and kv.used() == 0
    assert kv.match([1, 2, 3, 4]) == 3
    assert kv.try_admit([9], 0, 3)                 # 1 free + evicts 3 and 2 (oldest first)
    assert removed == [3, 2] and kv.evicted == 2 and kv.match([1, 2]) == 1
    assert not kv.try_admit([7], 0, 2)             # only block 1 is evictable: nothing changes
    assert kv.match([1]) == 1 and kv.used() == 3


def test_kvcache_shared_block_is_not_duplicated():
    kv = KVCache(8, 16)
    assert kv.try_admit([1, 2], 0, 2) and kv.try_admit([1, 2], 0, 2)
    kv.register([1, 2])
    kv.register([1, 2])                            # second computation of the same blocks: shared, anon freed
    assert kv.ref == {1: 2, 2: 2} and kv.free == 6


def test_prefix_hits_counted_exactly(tmp_path):
    reqs = [R(0, 0.0, 1024, 2, [1, 2]),            # 16 engine blocks of 64, all new
            R(1, 10.0, 1100, 2, [1, 2, 3]),        # hits both trace blocks: 1024 tokens
            R(2, 20.0, 1024, 2, [1, 9]),           # hits the first trace block: 512 tokens
            R(3, 30.0, 1024, 2, [1, 2])]           # full hit: the last block is recomputed -> 15 blocks = 960
    sim = Simulator(_dep(tmp_path), "smollm2", "round_robin")
    res = sim.run(reqs)
    assert [r.hit for r in res.records] == [0, 1024, 512, 960]
    assert res.summary["prefix_hit_rate"] == pytest.approx((1024 + 512 + 960) / (1024 + 1100 + 1024 + 1024))
    assert len(sim.index) == len(set(reqs[0].block_keys(64) + reqs[1].block_keys(64) + reqs[2].block_keys(64)))


def test_batching_and_decode_steps(tmp_path):
    reqs = [R(0, 0.0, 100, 5, [1]), R(1, 0.0, 200, 5, [2])]
    res = Simulator(_dep(tmp_path), "smollm2", "round_robin").run(reqs)
    a, b = res.records
    # first iteration: only request 0 (request 1 arrives while it runs? no: both at t=0, same iteration)
    t_pre = 0.01 + 0.001 * 300
    assert a.first_token == pytest.approx(t_pre) and b.first_token == pytest.approx(t_pre)
    step = 0.01 + 0.002 * 2                         # B = 2 decode sequences
    assert a.finish == pytest.approx(t_pre + 4 * step) and b.finish == pytest.approx(t_pre + 4 * step)
    assert res.summary["itl_ms"]["median"] == pytest.approx(step * 1000)
    assert res.summary["tpot_ms"]["mean"] == pytest.approx(step * 1000)


def test_chunked_prefill(tmp_path):
    res = Simulator(_dep(tmp_path, budget=256), "smollm2", "round_robin").run([R(0, 0.0, 600, 1, [1, 2])])
    rec = res.records[0]
    assert rec.first_token == pytest.approx(3 * 0.01 + 600 * 0.001)  # chunks 256 + 256 + 88
    assert res.summary["per_instance"]["cpu-x86-both-0"]["iterations"] == 3


def test_lru_eviction_reaches_router_index(tmp_path):
    # 40 blocks of 64 tokens; each request needs ceil((1024+1)/64) = 17 blocks
    reqs = [R(0, 0.0, 1024, 1, [1, 2]), R(1, 5.0, 1024, 1, [3, 4]), R(2, 10.0, 1024, 1, [5, 6])]
    sim = Simulator(_dep(tmp_path, blocks=40), "smollm2", "round_robin")
    sim.run(reqs)
    k0 = reqs[0].block_keys(64)
    k2 = reqs[2].block_keys(64)
    assert sim.index.match(k2) == {0: 16}
    # request 2 needs 17 blocks: 8 free + 9 evicted, the oldest are request 0's, tail first; the index knows
    assert sim.instances[0].kv.evicted == 9
    assert sim.index.match(k0) == {0: 7}
    assert sim.index.match(reqs[1].block_keys(64)) == {0: 16}


def test_pd_transfer_time_is_bytes_over_bandwidth_plus_latency(tmp_path):
    link = {"bandwidth_gbps": 8.0, "setup_ms": 2.0, "eff": 1.0}       # 1e9 bytes/s, 2 ms
    dep = {"name": "pd", "block_size": 64, "link": link,
           "instances": [{"chip": "cpu-x86", "role": "prefill", "timing": _calib(tmp_path), "num_gpu_blocks": 100},
                         {"chip": "cpu-x86", "role": "decode", "timing": _calib(tmp_path), "num_gpu_blocks": 100}]}
    sim = Simulator(dep, "smollm2", "round_robin")
    res = sim.run([R(0, 0.0, 1000, 3, [1, 2])])
    kv_bpt = 2 * 30 * 3 * 64 * 2                    # SmolLM2: layers 30, 3 KV heads, head_dim 64, bf16
    assert kv_bpt == sim.model.kv_bytes_per_token == 23040
    x = 0.002 + 1000 * kv_bpt / 1e9
    assert sim.transfers == [(1000, 1000 * kv_bpt, pytest.approx(x))]
    rec = res.records[0]
    t_pre = 0.01 + 0.001 * 1000
    assert rec.first_token == pytest.approx(t_pre + x + (0.01 + 0.002 * 1))   # D: one decode iteration, B=1
    assert rec.finish == pytest.approx(rec.first_token + 2 * 0.012)
    assert res.summary["pd_fraction"] == 1.0


def test_determinism_from_seed():
    a = shared_prefix(4, 5, 1024, 100, 16, rate=5.0, seed=3)
    b = shared_prefix(4, 5, 1024, 100, 16, rate=5.0, seed=3)
    c = shared_prefix(4, 5, 1024, 100, 16, rate=5.0, seed=4)
    assert [(r.arrival, list(r.hash_ids)) for r in a] == [(r.arrival, list(r.hash_ids)) for r in b]
    assert [r.arrival for r in a] != [r.arrival for r in c]
    runs = [Simulator("homog_h100x4", "llama-3.1-8b", "dlrouter_min_expected_latency", seed=7).run(
        shared_prefix(4, 5, 1024, 100, 16, rate=5.0, seed=3)).summary for _ in range(2)]
    for s in runs:
        s.pop("per_instance")
    assert runs[0] == runs[1]


def test_shared_prefix_structure():
    reqs = shared_prefix(3, 4, 1024, 600, 8, rate=1.0, seed=0)
    assert len(reqs) == 12 and all(r.input_len == 1624 for r in reqs)
    groups = {}
    for r in reqs:
        groups.setdefault(tuple(r.hash_ids[:2]), []).append(r)
    assert len(groups) == 3 and all(len(v) == 4 for v in groups.values())
    tails = [h for r in reqs for h in r.hash_ids[2:]]
    assert len(tails) == len(set(tails)) == 12 * 2


def test_mooncake_trace_fixture():
    reqs = load_trace("mooncake")
    assert len(reqs) == 12031
    assert (reqs[0].input_len, reqs[0].output_len, list(reqs[0].hash_ids)) == (6758, 500, list(range(14)))
    assert reqs[-1].arrival <= 3600.0
    assert len(reqs[0].block_keys(64)) == 6758 // 64
    assert ideal_reuse(reqs) == pytest.approx(0.3736, abs=1e-4)
    assert load_trace("mooncake", speedup=2.0, limit=3)[2].arrival == pytest.approx(reqs[2].arrival / 2)


def test_pseudo_text_shares_prefix_with_hash_ids():
    a, b, c = R(0, 0, 600, 1, [5, 6]), R(1, 0, 600, 1, [5, 7]), R(2, 0, 600, 1, [8])
    assert a.text(100)[:64] == b.text(100)[:64] and a.text(100) != b.text(100)
    assert len(a.text(100)) == 100 and a.text(100)[:64] != c.text(100)[:64]


def test_bad_inputs(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n{"timestamp": 1}\n')
    with pytest.raises(WorkloadError, match="bad.jsonl:2"):
        load_trace(str(p))
    with pytest.raises(WorkloadError):
        load_trace("no/such/trace.jsonl")
    with pytest.raises(ConfigError, match="unknown chip"):
        load_deployment({"instances": [{"chip": "NoSuchChip"}]})
    with pytest.raises(ConfigError, match="role"):
        load_deployment({"instances": [{"chip": "H100", "role": "oops"}]})
    with pytest.raises(ConfigError, match="decode"):
        load_deployment({"instances": [{"chip": "H100", "role": "prefill"}]})
    with pytest.raises(ValueError, match=">= 1"):
        R(0, 0, 100, 1, [1]).block_keys(0)
    with pytest.raises(WorkloadError, match="trace_block"):
        shared_prefix(1, 2, 256, 64, 2, rate=1.0, trace_block=0)
    with pytest.raises(ConfigError, match="slo.itl_ms"):
        load_deployment({"instances": [{"chip": "H100"}], "slo": {"itl_ms": 0}})
    with pytest.raises(ConfigError, match="unknown keys"):
        load_deployment({"instances": [{"chip": "H100"}], "slo": {"itl": 50}})
    with pytest.raises(ConfigError, match="slo.pct"):
        load_deployment({"instances": [{"chip": "H100"}], "slo": {"pct": 120}})


def test_request_too_large_for_kv_fails_cleanly(tmp_path):
    res = Simulator(_dep(tmp_path, blocks=4), "smollm2", "round_robin").run(
        [R(0, 0.0, 1024, 1, [1, 2]), R(1, 1.0, 100, 2, [3])])
    assert res.summary["failed"] == 1 and res.summary["completed"] == 1
    assert res.records[0].failed and not res.records[1].failed


def test_linear_timing_builtin_profile_loads():
    t = LinearTiming.load("smollm2_vllm_cpu")
    assert t.c0 > 0 and t.c_tok >= 0 and t.c_quad >= 0 and math.isfinite(t.r0)


def test_unbounded_cache_reaches_ideal_reuse_on_the_trace():
    # requests far apart (no overlap) on one instance with room for everything: the simulated hits must equal the
    # ideal reuse counted at engine-block granularity (leading keys seen before, at most (n-1)//bs blocks)
    reqs = load_trace("mooncake", limit=60)
    for i, r in enumerate(reqs):
        r.arrival = 100.0 * i
    dep = {"name": "big", "block_size": 64, "instances": [{"chip": "H100", "num_gpu_blocks": 10_000_000}]}
    res = Simulator(dep, "llama-3.1-8b", "round_robin").run(reqs)
    seen = set()
    expect = []
    for r in reqs:
        ks = r.block_keys(64)
        k = 0
        while k < len(ks) and ks[k] in seen:
            k += 1
        expect.append(min(k, (r.input_len - 1) // 64) * 64)
        seen.update(ks)
    assert [x.hit for x in res.records] == expect
    assert sum(expect) > 0


def test_decode_span_closed_form_equals_sum_of_iterations():
    from dlmix.hw import load_catalog
    from dlmix.hw.cost import PRESETS
    from dlmix.sim.timing import RooflineTiming

    cat = load_catalog()
    lin = LinearTiming(**LIN)
    for t in [RooflineTiming(cat.chip(c), PRESETS["llama-3.1-8b"]) for c in ("H100", "H20", "cpu-x86")] + [lin]:
        for b, s, j in ((1, 0, 1), (8, 96_000, 37), (64, 4_000_000, 300), (300, 100, 5)):
            ref = sum(t.iteration(0, 0, 0, b, s + i * b) for i in range(j))
            assert t.decode_cum(b, s, j) == pytest.approx(ref, rel=1e-9)


def test_decode_spans_do_not_change_results():
    reqs = load_trace("mooncake", speedup=4.0, limit=300)
    out = []
    for ff in (False, True):
        sim = Simulator("homog_h100x4", "llama-3.1-8b", "cost")
        for i in sim.instances:
            i.fast_forward = ff
        s = sim.run(reqs).summary
        out.append((s["ttft_ms"], s["tpot_ms"], s["e2el_ms"], s["prefix_hit_rate"],
                    [v["iterations"] for v in s["per_instance"].values()]))
    assert out[0][4] == out[1][4]
    for a, b in zip(out[0][:3], out[1][:3]):
        assert a == pytest.approx(b, rel=1e-9)
    assert out[0][3] == out[1][3]


def test_kv_event_delay_hides_fresh_blocks_from_the_router(tmp_path):
    dep = _dep(tmp_path)
    dep["instances"][0]["count"] = 2
    placed = {}
    for delay in (0.0, 100.0):
        reqs = [R(0, 0.0, 1024, 2, [1, 2]), R(1, 5.0, 1024, 2, [1, 2])]
        sim = Simulator(dep, "smollm2", "prefix", kv_event_delay=delay, approx_index=False)
        res = sim.run(reqs)
        placed[delay] = [r.decode_inst.idx for r in res.records]
        # delayed events are applied in the end: every instance that computed the prefix holds it
        assert sim.index.match(reqs[0].block_keys(64)) == {i: 16 for i in set(placed[delay])}
    assert placed[0.0] == [0, 0]      # the router sees request 0's blocks on instance 0
    assert placed[100.0] == [0, 1]    # not yet: least loaded / fewest processed
    # with the router's approximate index (the default, as in the live router) the dispatch itself is recorded
    reqs = [R(0, 0.0, 1024, 2, [1, 2]), R(1, 5.0, 1024, 2, [1, 2])]
    res = Simulator(dep, "smollm2", "prefix", kv_event_delay=100.0).run(reqs)
    assert [r.decode_inst.idx for r in res.records] == [0, 0]


def test_early_rejection_is_counted_and_uses_no_capacity():
    # 6 requests of 16k tokens arrive together on one H100: each prefill takes ~0.35 s by the cost model, so with a
    # 1 s TTFT target the first ones are admitted and the rest predicted late and refused
    dep = {"name": "one", "block_size": 64, "instances": [{"chip": "H100", "count": 1}]}
    reqs = [R(i, 0.0, 16384, 4, [100 + i]) for i in range(6)]
    params = {"ttft_target": 1.0, "reject_ttft_factor": 1.0}
    res = Simulator(dep, "llama-3.1-8b", "cost", policy_params=params).run(reqs, slo_ttft=1.0)
    s = res.summary
    rejected = [r for r in res.records if r.rejected]
    assert 0 < s["rejected"] == len(rejected) == s["failed"] < 6
    assert all(r.decode_inst is None for r in rejected)  # never dispatched
    inst = s["per_instance"]["H100-both-0"]
    assert inst["requests"] == 6 - s["rejected"]
    assert inst["prefill_tokens"] == (6 - s["rejected"]) * 16384
    ok = [r for r in res.records if not r.rejected]
    assert max(r.first_token - r.req.arrival for r in ok) <= 1.0 * 1.2  # admitted ones roughly keep the target


def test_sim_cli_policy_param_and_slo_reach_the_cost_policy():
    import json

    from typer.testing import CliRunner

    from dlmix.cli import app

    args = ["sim", "-d", "homog_h100x4", "-w", "mooncake", "--limit", "300", "--speedup", "2", "-p", "cost"]
    base = CliRunner().invoke(app, args)
    assert base.exit_code == 0, base.output
    rej = CliRunner().invoke(app, args + ["--policy-param", "reject_ttft_factor=1"])
    assert rej.exit_code == 0, rej.output
    s0, s1 = json.loads(base.output.strip().splitlines()[-1])[0], json.loads(rej.output.strip().splitlines()[-1])[0]
    assert s0["rejected"] == 0 and s1["rejected"] > 0  # admission control only when asked for
    assert "rej%" in rej.output
    # a tighter --slo-ttft-ms is the cost policy's target too: more requests predicted to miss it are refused
    tight = CliRunner().invoke(app, args + ["--policy-param", "reject_ttft_factor=1", "--slo-ttft-ms", "500"])
    assert json.loads(tight.output.strip().splitlines()[-1])[0]["rejected"] > s1["rejected"]
    bad = CliRunner().invoke(app, args + ["--policy-param", "oops"])
    assert bad.exit_code == 2 and "key=value" in bad.output


def test_block_keys_for_block_sizes_that_do_not_divide_the_trace_block():
    """Trace block 16 tokens, engine block 64: engine block j is keyed by the id of the trace block holding its last
    token (index 4j + 3) and the offset 16 into it, so two prompts agree on engine block 0 iff they agree on ids 0..3
    (chained ids). Trace block 512, engine block 48 (neither divides the other): a 600-token prompt has 600 // 48 =
    12 keys; blocks 0..9 end inside trace block 0 (480 tokens), block 10 (tokens 480..527) ends in trace block 1."""
    a = SimRequest(0, 0.0, 130, 1, [1, 2, 3, 4, 5, 6, 7, 8, 9], trace_block=16)
    b = SimRequest(1, 0.0, 130, 1, [1, 2, 3, 4, 50, 60, 70, 80, 90], trace_block=16)
    c = SimRequest(2, 0.0, 130, 1, [1, 2, 3, 40, 5, 6, 7, 8, 9], trace_block=16)
    assert len(a.block_keys(64)) == 130 // 64 == 2
    assert a.block_keys(64)[0] == b.block_keys(64)[0] and a.block_keys(64)[1] != b.block_keys(64)[1]
    assert a.block_keys(64)[0] != c.block_keys(64)[0]
    assert len(a.block_keys(16)) == 8 and len(set(a.block_keys(16)) & set(a.block_keys(64))) == 0
    x, y = R(0, 0.0, 600, 1, [1, 2]), R(1, 0.0, 600, 1, [1, 3])
    kx, ky = x.block_keys(48), y.block_keys(48)
    assert len(kx) == 12 and kx[:10] == ky[:10] and kx[10] != ky[10]


def test_synthetic_prefix_shorter_than_512_hits_whole_engine_blocks(tmp_path):
    """1 group × 4 requests of 240 shared + 64 own tokens (304), 10 s apart so each prefill ends before the next
    arrives; hash ids per 16 tokens (the deployment's ``hash_block``). The first request misses, the other three hit
    the whole engine blocks inside the 240-token prefix: block size 16 -> 15 blocks = 240 tokens, hit rate
    3·240 / (4·304) = 720/1216 = 59.21 %; block size 32 -> 7 blocks = 224 tokens, 3·224 / 1216 = 672/1216 = 55.26 %.
    With Mooncake's 512-token hash blocks (the old synthetic default) the prefix shares no full block: 0 %."""
    def run(bs, trace_block):
        dep = load_deployment(_dep(tmp_path, bs=bs))
        reqs = shared_prefix(1, 4, 240, 64, 2, rate=1.0, seed=0, trace_block=trace_block or dep.hash_block())
        for i, r in enumerate(reqs):
            r.arrival = 10.0 * i
        return Simulator(dep, "smollm2", "round_robin").run(reqs)

    r16, r32, old = run(16, None), run(32, None), run(32, 512)
    assert [r.hit for r in r16.records] == [0, 240, 240, 240]
    assert r16.summary["prefix_hit_rate"] == pytest.approx(720 / 1216)
    assert [r.hit for r in r32.records] == [0, 224, 224, 224]
    assert r32.summary["prefix_hit_rate"] == pytest.approx(672 / 1216)
    assert old.summary["prefix_hit_rate"] == 0.0


def test_mixed_block_sizes_hash_at_their_gcd(tmp_path):
    """Instances with block size 16 and 32: ``hash_block`` = gcd = 16. One group of 4 requests (240 shared + 64 own
    tokens) 10 s apart, round robin: each instance sees two; its first misses, its second hits the whole blocks of
    its own size in the prefix: 240 (15 × 16) and 224 (7 × 32). Hit rate (240 + 224) / (4 · 304) = 464/1216."""
    cal = _calib(tmp_path)
    dep = load_deployment({"name": "mixed", "instances": [
        {"chip": "cpu-x86", "timing": cal, "num_gpu_blocks": 1000, "block_size": 16},
        {"chip": "cpu-x86", "timing": cal, "num_gpu_blocks": 1000, "block_size": 32}]})
    assert dep.hash_block() == 16
    assert load_deployment(_dep(tmp_path, bs=64)).hash_block() == 64
    reqs = shared_prefix(1, 4, 240, 64, 2, rate=1.0, seed=0, trace_block=dep.hash_block())
    for i, r in enumerate(reqs):
        r.arrival = 10.0 * i
    res = Simulator(dep, "smollm2", "round_robin").run(reqs)
    assert sorted((r.prefill_inst.bs, r.hit) for r in res.records) == [(16, 0), (16, 240), (32, 0), (32, 224)]
    assert res.summary["prefix_hit_rate"] == pytest.approx(464 / 1216)


def _sim_cli(args):
    import json

    from typer.testing import CliRunner

    from dlmix.cli import app

    res = CliRunner().invoke(app, ["sim"] + args)
    assert res.exit_code == 0, res.output
    return res.output, json.loads(res.output.strip().splitlines()[-1])


def test_sim_cli_synthetic_uses_the_deployment_block_size():
    """The user's case: ``smollm2_cpu`` (block size 32), 2 groups × 4 requests of 256 shared + 64 own tokens at
    1 req/s. Each group's first request misses; the other 6 hit the 8 full 32-token blocks of the prefix (256
    tokens): 6·256 / (8·320) = 1536/2560 = 60.0 % (it was 0.0 % with 512-token hash blocks). With 512 shared
    tokens: 6·512 / (8·576) = 66.7 %, as before."""
    base = ["-d", "smollm2_cpu", "-m", "smollm2", "-w", "synthetic", "--groups", "2", "--per-group", "4",
            "--suffix-len", "64", "--rate", "1"]
    _, s256 = _sim_cli(base + ["--prefix-len", "256"])
    _, s512 = _sim_cli(base + ["--prefix-len", "512"])
    assert s256[0]["prefix_hit_rate"] == pytest.approx(1536 / 2560)
    assert s512[0]["prefix_hit_rate"] == pytest.approx(3072 / 4608)


def test_sim_cli_slo_from_the_deployment_file_unless_flagged(tmp_path):
    """A deployment file with ``slo: {ttft_ms: 1500, itl_ms: 50}`` (as ``dlmix plan`` writes it): ``dlmix sim``
    judges goodput against TTFT 1500 ms / TPOT 50 ms; an explicit ``--slo-itl-ms 30`` wins for ITL only; a file
    without ``slo`` gets the defaults 2000 / 25 ms."""
    import yaml

    from dlmix.sim.cli import resolve_slo

    d = _dep(tmp_path)
    d["slo"] = {"ttft_ms": 1500, "itl_ms": 50, "pct": 90}
    p = tmp_path / "dep.yaml"
    p.write_text(yaml.safe_dump(d))
    dep = load_deployment(str(p))
    assert (dep.slo_ttft, dep.slo_itl, dep.slo_pct) == (1.5, 0.05, 90.0)
    assert resolve_slo(dep) == (1.5, 0.05, "ttft: deployment, itl: deployment")
    assert resolve_slo(dep, None, 30.0) == (1.5, 0.03, "ttft: deployment, itl: flag")
    assert resolve_slo(load_deployment(_dep(tmp_path))) == (2.0, 0.025, "ttft: default, itl: default")
    with pytest.raises(ValueError, match="slo-itl-ms"):
        resolve_slo(dep, None, 0.0)
    args = ["-d", str(p), "-m", "smollm2", "-w", "mooncake", "--limit", "5"]
    out, s = _sim_cli(args)
    assert s[0]["goodput_targets_ms"] == {"ttft": 1500.0, "tpot": 50.0}
    assert "SLO TTFT 1500 ms, ITL 50 ms (ttft: deployment, itl: deployment)" in out
    _, s = _sim_cli(args + ["--slo-itl-ms", "30"])
    assert s[0]["goodput_targets_ms"] == {"ttft": 1500.0, "tpot": 30.0}
    _, s = _sim_cli(["-d", "smollm2_cpu", "-m", "smollm2", "-w", "mooncake", "--limit", "5"])
    assert s[0]["goodput_targets_ms"] == {"ttft": 2000.0, "tpot": 25.0}


def test_deployment_values_that_break_the_simulator_are_refused(tmp_path):
    """Found by a new-user review: each of these used to give a traceback, a hang or a silent nonsense run."""
    h = {"chip": "H100"}
    pd = [{"chip": "H100", "role": "prefill"}, {"chip": "H20", "role": "decode"}]
    cases = [
        ({"instances": [dict(h, num_gpu_blocks=-3)]}, "num_gpu_blocks"),           # was ValueError traceback
        ({"instances": [dict(h, num_gpu_blocks=0)]}, "num_gpu_blocks"),            # was silently the default
        ({"instances": [dict(h, num_gpu_blocks="x")]}, "invalid literal"),         # was ValueError traceback
        ({"link": {"bandwidth_gbps": 0}, "instances": pd}, "bandwidth_gbps"),      # was ZeroDivisionError
        ({"link": {"bandwidth_gbps": -5}, "instances": pd}, "bandwidth_gbps"),     # was a run at -5 Gb/s
        ({"instances": [dict(h, timing="no_such_profile")]}, "timing"),           # was FileNotFoundError traceback
        ({"t_step": -1, "instances": [h]}, "t_step"),                              # was utilization -7e10 %
        ({"instances": [dict(h, r0=-5)]}, "r0"),
        ({"instances": [dict(h, count=10 ** 9)]}, "at most"),                       # was a hang
        ({"nme": "typo", "instances": [h]}, "unknown keys"),                       # was silently ignored
        ({"gpu_memory_utilization": 9, "instances": [h]}, "gpu_memory_utilization"),
    ]
    for d, match in cases:
        with pytest.raises(ConfigError, match=match):
            load_deployment(d)


@pytest.mark.parametrize("extra", [["--limit", "0"], ["--limit", "-5"], ["-w", "synthetic", "--limit", "-5"],
                                   ["--kv-event-delay-ms", "-1"], ["-w", "EMPTY"],
                                   ["--limit", "3", "-o", "EMPTY"]])
def test_sim_cli_refuses_bad_limit_and_delay(extra, tmp_path):
    from typer.testing import CliRunner

    from dlmix.cli import app

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    extra = [str(empty) if a == "EMPTY" else a for a in extra]
    res = CliRunner().invoke(app, ["sim", "-d", "homog_h100x4"] + extra)
    assert res.exit_code == 2 and any(w in res.output for w in ("must be", "no requests", "not a folder")), res.output


def _sim_cli_error(args):
    from typer.testing import CliRunner

    from dlmix.cli import app

    res = CliRunner().invoke(app, ["sim"] + args)
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    assert res.exit_code == 2, (res.exit_code, res.output[-800:])
    return res.output


def test_sim_refuses_a_tp_size_the_model_heads_do_not_allow(tmp_path):
    """New-user review: ``dlmix sim`` simulated Llama-3.1-8B (32 heads, 8 KV heads) on 3-chip instances, which vLLM
    refuses and ``dlmix plan`` never proposes. The simulator now applies the planner's rule
    (``ModelSpec.allowed_tp_sizes`` of ``kv_tp``); SmolLM2 (9 heads, 3 KV heads) at TP 9 is fine, a CPU instance
    of 3 cores is TP 1."""
    import yaml

    from dlmix.sim.config import check_model
    from dlmix.sim.config import load_model

    p = tmp_path / "tp3.yaml"
    p.write_text(yaml.safe_dump({"name": "tp3", "instances": [{"chip": "H100", "count": 1, "num_chips": 3}]}))
    out = _sim_cli_error(["-d", str(p), "-m", "llama-3.1-8b", "-w", "mooncake", "--limit", "3"])
    assert "num_chips 3 (TP 3)" in out and "TP 1, 2, 4, 8, 16, 32 only" in out, out
    check_model(load_deployment({"instances": [{"chip": "H100", "num_chips": 9}]}), load_model("smollm2"))
    check_model(load_deployment({"instances": [{"chip": "cpu-x86", "num_chips": 3}]}), load_model("llama-3.1-8b"))
    with pytest.raises(ConfigError, match="num_chips 2"):
        check_model(load_deployment({"instances": [{"chip": "H100", "num_chips": 2}]}), load_model("smollm2"))


def test_requests_beyond_the_context_limit_are_refused(tmp_path):
    """New-user review: SmolLM2 (8192-token context) on the Mooncake trace reported 99.5 % good, simulating prompts
    of up to 87k tokens. vLLM refuses a request whose prompt + max_tokens exceed max_model_len (HTTP 400): the
    simulator now fails such a request at arrival (never routed), counts it in ``too_long`` and not as good."""
    reqs = [R(0, 0.0, 8000, 192, [1]), R(1, 1.0, 8000, 193, [2]), R(2, 2.0, 9000, 1, [3])]
    res = Simulator(_dep(tmp_path), "smollm2", "round_robin").run(reqs)
    s = res.summary
    assert (s["completed"], s["failed"], s["too_long"], s["rejected"]) == (1, 2, 2, 0), s
    assert [r.too_long for r in res.records] == [False, True, True]
    assert s["good_fraction"] <= 1 / 3
    assert s["per_instance"][next(iter(s["per_instance"]))]["requests"] == 1  # the long ones never reached it
    out, summ = _sim_cli(["-d", "smollm2_cpu", "-m", "smollm2", "-w", "mooncake", "--limit", "20"])
    assert summ[0]["too_long"] > 0 and "refused at arrival" in out, out[-800:]


@pytest.mark.parametrize("extra,match", [
    (["-p", "cost,cost"], "--policy lists cost more than once"),
    (["-p", "round_robin,cost,round_robin"], "--policy lists round_robin more than once"),
    (["--slo-itl-ms", "1e400"], "--slo-itl-ms must be a finite number > 0"),
    (["--slo-ttft-ms", "inf"], "--slo-ttft-ms must be a finite number > 0"),
    (["--policy-param", "itl_target=1e400"], "itl_target: Input should be a finite number"),
    (["--policy-param", "ttft_target=nan"], "ttft_target: Input should be a finite number"),
])
def test_sim_cli_refuses_duplicate_policies_and_non_finite_slo(extra, match):
    out = _sim_cli_error(["-d", "homog_h100x4", "-w", "mooncake", "--limit", "3"] + extra)
    assert match in out, out


def test_deployment_slo_must_be_finite():
    with pytest.raises(ConfigError, match="slo.itl_ms must be a finite number > 0"):
        load_deployment({"instances": [{"chip": "H100"}], "slo": {"itl_ms": 1e400}})


def test_sim_cli_refuses_huge_synthetic_workloads():
    """The same bounds as the planner's synthetic workload (``dlmix.workloads.SHARED_PREFIX_MAX_*``)."""
    base = ["-d", "homog_h100x4", "-w", "synthetic"]
    assert "--groups × --per-group must be at most 100000" in _sim_cli_error(base + ["--groups", "100000000"])
    assert "--prefix-len + --suffix-len must be at most 1048576" in _sim_cli_error(base + ["--prefix-len",
                                                                                          "1000000000"])
    # each bound names the flag (before: "groups >= 1, prompts per group >= 1, output_len >= 1, ..." for any of them)
    assert "shared-prefix: --suffix-len must be >= 0 tokens, got -1" in _sim_cli_error(base + ["--suffix-len", "-1"])
    assert "--prefix-len + --suffix-len must be >= 1 token" in _sim_cli_error(base + ["--prefix-len", "0",
                                                                                     "--suffix-len", "0"])


def test_sim_names_its_own_synthetic_flags_for_the_planners_spelling():
    """``dlmix plan -w synthetic:groups=4,...`` then ``dlmix sim ... -w synthetic:groups=4,...`` (the same spelling):
    sim said "trace 'synthetic:groups=4' not found"; it names its own flags instead (exit 2)."""
    from typer.testing import CliRunner

    from dlmix.cli import app

    res = CliRunner().invoke(app, ["sim", "-d", "homog_h100x4", "-w", "synthetic:groups=4,per_group=4"])
    assert res.exit_code == 2, res.output
    assert "dlmix sim takes -w synthetic with its own flags (--groups, --per-group" in " ".join(res.output.split())


def test_instances_are_named_by_the_catalogs_chip_name_whatever_the_spelling():
    """``chip: h100`` and ``chip: H100`` are one chip: instance ids, ``chip`` and ``router_chip`` carry the
    catalog's name (before: ``h100-prefill-0`` beside ``H100-prefill-1`` in one report)."""
    from dlmix.sim.config import deployment_from_dict

    dep = deployment_from_dict({"instances": [{"chip": "h100", "role": "prefill", "router_chip": "h20"},
                                              {"chip": "H100", "role": "prefill"}, {"chip": "h20", "role": "decode"}]})
    assert [(i.id, i.chip) for i in dep.instances] == [("H100-prefill-0", "H100"), ("H100-prefill-1", "H100"),
                                                       ("H20-decode-2", "H20")]
    assert dep.instances[0].router_chip == "H20"


def test_sim_refuses_synthetic_flags_with_a_trace_workload():
    """``dlmix sim -w mooncake --groups 4 --rate 2``: the synthetic generator's flags do not apply to a trace; they
    were ignored without a word (the run simulated the trace as it is). Now an input error naming them; with
    ``-w synthetic`` they work as before, and a trace run without them is unchanged."""
    out = _sim_cli_error(["-d", "homog_h100x4", "-w", "mooncake", "--groups", "4", "--rate", "2", "--limit", "3"])
    assert "--groups, --rate shape the synthetic workload (-w synthetic), not the trace 'mooncake'" in out
    from typer.testing import CliRunner

    from dlmix.cli import app

    for args in (["-w", "synthetic", "--groups", "2", "--per-group", "2"], ["-w", "mooncake", "--limit", "3"]):
        res = CliRunner().invoke(app, ["sim", "-d", "homog_h100x4"] + args)
        assert res.exit_code == 0, res.output[-800:]
