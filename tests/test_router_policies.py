"""Policies as pure objects over plain state (what the simulator uses): exact placements."""
from __future__ import annotations

import pytest

from dlmix.hw.cost import CostModel
from dlmix.routing.policies import ClusterView, begin, end, make_policy, prefill_done
from dlmix.routing.prefix_index import PrefixIndex
from dlmix.routing.state import InstanceState, NoInstanceError, RouteRequest


def inst(i, role="both", chip="H100", **kw):
    return InstanceState(id=f"i{i}", url=f"http://h:{i}", role=role, chip=chip, slot=i, model=("m",),
                         transport={"link": "rdma-100g"}, **kw)


def req(n=0, hashes=(), model="m", max_tokens=None):
    return RouteRequest(model=model, prompt_len=n, block_hashes=lambda bs: list(hashes), max_tokens=max_tokens)


def test_round_robin_rotates_and_skips_unhealthy():
    xs = [inst(i) for i in range(3)]
    xs[1].healthy = False
    p = make_policy("round_robin")
    picks = [p.choose(req(), ClusterView(xs)).decode.id for _ in range(4)]
    assert picks == ["i2", "i0", "i2", "i0"]
    with pytest.raises(NoInstanceError):
        p.choose(req(model="other"), ClusterView(xs))


def test_round_robin_pd_pools_rotate_independently():
    xs = [inst(0, role="prefill"), inst(1, role="prefill"), inst(2, role="decode"), inst(3, role="decode")]
    p = make_policy("round_robin")
    ds = [p.choose(req(), ClusterView(xs)) for _ in range(4)]
    assert [d.prefill.id for d in ds] == ["i1", "i0", "i1", "i0"]
    assert [d.decode.id for d in ds] == ["i3", "i2", "i3", "i2"]


def test_least_load_and_bookkeeping():
    xs = [inst(i) for i in range(3)]
    p = make_policy("least_load")
    r = req(100)
    ds = []
    for _ in range(3):
        d = p.choose(r, ClusterView(xs))
        begin(d, r)
        ds.append(d)
    assert sorted(d.decode.id for d in ds) == ["i0", "i1", "i2"]
    assert [x.load.inflight_prefill_tokens for x in xs] == [100, 100, 100]
    prefill_done(ds[0], r)
    assert ds[0].decode.load.inflight_decode == 1 and ds[0].decode.load.decode_ctx_tokens == 100
    end(ds[0], r)
    end(ds[1], r, prefilled=False)
    assert [x.load.inflight for x in xs] == [0, 0, 1] and xs[1].load.inflight_prefill_tokens == 0


def test_prefix_prefers_hit_but_guards_load():
    xs = [inst(i) for i in range(4)]
    ix = PrefixIndex()
    ix.store(2, [1, 2, 3, 4])
    p = make_policy("prefix", balance_abs_threshold=2, balance_rel_threshold=1.5)
    r = req(64, hashes=[1, 2, 3, 4])
    assert p.choose(r, ClusterView(xs, index=ix)).decode.id == "i2"
    xs[2].load.inflight = 3  # 3 - 0 > 2 and 3 > 1.5*0: overloaded -> filtered
    assert p.choose(r, ClusterView(xs, index=ix)).decode.id != "i2"
    for x in xs:
        x.load.inflight = 10
    xs[2].load.inflight = 16  # 16 > 1.5*10 and 6 > 2: overloaded
    assert p.choose(r, ClusterView(xs, index=ix)).decode.id != "i2"
    xs[2].load.inflight = 12  # within the relative threshold -> the hit wins
    assert p.choose(r, ClusterView(xs, index=ix)).decode.id == "i2"
    # below cache_threshold: least load
    r2 = req(64 * 100, hashes=[1])
    xs[0].load.inflight = 1
    assert p.choose(r2, ClusterView(xs, index=ix)).decode.id == "i0"


def cost_view(xs, ix=None):
    return ClusterView(xs, index=ix, cost=CostModel("llama-3.1-8b"))


def test_cost_disaggregates_long_prompts_to_fast_prefill_chip():
    xs = [inst(0, "prefill", "H100"), inst(1, "prefill", "H20"), inst(2, "decode", "H20")]
    p = make_policy("cost")
    d = p.choose(req(4096), cost_view(xs))
    assert (d.prefill.id, d.decode.id, d.reason) == ("i0", "i2", "cost:pd")
    # expected TTFT = prefill on H100 + transfer of 4096 tokens' KV + t1
    cm = CostModel("llama-3.1-8b")
    exp = cm.prefill_time("H100", 4096) + cm.transfer_time(4096, "rdma-100g") + cm.t1
    assert d.predicted_ttft == pytest.approx(exp)
    # short prompt: prefill locally on the decode instance
    d = p.choose(req(100), cost_view(xs))
    assert d.prefill is None and d.reason == "cost:local:short"


def test_cost_mostly_cached_prompt_stays_local_and_queue_moves_prefill():
    xs = [inst(0, "prefill", "H100"), inst(1, "prefill", "H100"), inst(2, "decode", "H20")]
    ix = PrefixIndex()
    ix.store(2, list(range(250)))  # D holds 4000 of 4096 tokens
    p = make_policy("cost")
    d = p.choose(req(4096, hashes=range(256)), cost_view(xs, ix))
    assert d.prefill is None and d.decode.id == "i2"
    xs[0].load.inflight_prefill_tokens = 50_000  # i0 has a long prefill queue -> i1
    d = p.choose(req(4096), cost_view(xs))
    assert d.prefill.id == "i1"


def test_cost_respects_itl_target():
    xs = [inst(0, "prefill", "H100"), inst(1, "decode", "H20"), inst(2, "decode", "H20")]
    xs[1].load.inflight_decode = 200
    xs[1].load.decode_ctx_tokens = 200 * 8000  # step time far above 50 ms
    p = make_policy("cost", itl_target=0.05)
    assert p.choose(req(4096), cost_view(xs)).decode.id == "i2"


def test_cost_cross_cluster_balances_completion_time():
    # only `both` instances on different chips: predicted completion time = queue + prefill + out * step
    fast, slow = inst(0, "both", "H100"), inst(1, "both", "L20")
    p = make_policy("cost")
    picks = []
    for _ in range(12):
        r = req(8000, max_tokens=16)
        d = p.choose(r, cost_view([fast, slow]))
        begin(d, r)  # prefill queues build up (no prefill_done)
        picks.append(d.decode.id)
    # H100 prefills 8000 tokens ~8x faster than L20: it takes the first ones, L20 gets work once H100's queue
    # makes it slower
    assert picks[:5] == ["i0"] * 5 and "i1" in picks
    assert picks.count("i0") > picks.count("i1")


def test_cost_avoids_full_kv_cache():
    xs = [inst(0, "decode", "H20"), inst(1, "decode", "H20")]
    cm = CostModel("llama-3.1-8b")
    cap = cm.kv_capacity_tokens("H20")
    assert cap == int((0.9 * 96e9 - 8.03e9 * 2) / 131072)
    xs[0].load.decode_ctx_tokens = cap - 100  # would overflow with a 1000-token prompt
    p = make_policy("cost")
    assert p.choose(req(1000), cost_view(xs)).decode.id == "i1"
    xs[0].load.decode_ctx_tokens = 0
    xs[1].load.kv_usage = 0.99  # engine-reported
    xs[0].load.inflight = 1
    assert p.choose(req(1000), cost_view(xs)).decode.id == "i0"


def test_cost_keeps_a_prefix_hit_on_the_busier_instance():
    # i0 caches 6144 of the 7344 prompt tokens but decodes 3x more requests than i1. A miss on i1 would prefill
    # 7344 tokens (~6x the work) and stall i1's decodes for that long; the SLO-normalised harm term keeps the hit.
    xs = [inst(0), inst(1)]
    for x, b in ((xs[0], 12), (xs[1], 4)):
        x.load.inflight = x.load.inflight_decode = b
        x.load.decode_ctx_tokens = b * 7344
    ix = PrefixIndex()
    ix.store(0, list(range(384)))  # 384 blocks of 16 tokens
    p = make_policy("cost", itl_target=0.025)
    r = req(7344, hashes=range(459))
    d = p.choose(r, cost_view(xs, ix))
    assert (d.decode.id, d.hit_tokens, d.reason) == ("i0", 6144, "cost:local")
    assert p.choose(r, cost_view(xs)).decode.id == "i1"  # without the prefix: the less loaded instance


def test_cost_conditional_disaggregation_keeps_long_prefills_off_decode_instances():
    # the only prefill instance has a long queue and the decode instance is idle: a long prompt is still
    # disaggregated (a local prefill would stall a decode chip), a short one is prefilled on D
    xs = [inst(0, "prefill", "H100"), inst(1, "decode", "H100")]
    xs[0].load.inflight_prefill_tokens = 20 * 10_000  # 20 queued prompts of 10k tokens
    xs[0].load.inflight_prefill_sq = 20 * 10_000 ** 2
    xs[0].load.inflight = 20
    p = make_policy("cost", itl_target=0.025)
    d = p.choose(req(4096), cost_view(xs))
    assert (d.prefill.id, d.decode.id, d.reason) == ("i0", "i1", "cost:pd")
    cm = CostModel("llama-3.1-8b")
    # the queue (linear and attention terms) is in the prediction
    queue = 20 * (cm.prefill_time("H100", 10_000) - cm.t0)
    exp = queue + cm.prefill_time("H100", 4096) + cm.transfer_time(4096, "rdma-100g") + cm.t1
    assert d.predicted_ttft == pytest.approx(exp)
    d = p.choose(req(200), cost_view(xs))
    assert (d.prefill, d.decode.id, d.reason) == (None, "i1", "cost:local:short")


def test_cost_early_rejection_raises_overloaded():
    from dlmix.routing.state import OverloadedError

    xs = [inst(0, "both", "H20")]
    cm = CostModel("llama-3.1-8b")
    n = 40_000
    assert cm.prefill_time("H20", n) > 2.0  # cannot meet a 2 s TTFT target on an idle H20
    assert make_policy("cost").choose(req(n), cost_view(xs)).decode.id == "i0"  # off by default
    p = make_policy("cost", ttft_target=2.0, reject_ttft_factor=1.0)
    with pytest.raises(OverloadedError, match="early rejection"):
        p.choose(req(n), cost_view(xs))
    assert p.choose(req(1000), cost_view(xs)).decode.id == "i0"  # a short prompt is admitted
    assert issubclass(OverloadedError, NoInstanceError)  # the router answers 503
