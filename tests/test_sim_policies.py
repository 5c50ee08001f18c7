"""Baseline policies (published formulas) on hand-made router state."""
import pytest

from dlmix.routing.policies.base import ClusterView
from dlmix.routing.policies.dlrouter_min_latency import DLRouterMinExpectedLatency
from dlmix.routing.policies.dlrouter_prefix_cache import DLRouterPrefixCache
from dlmix.routing.policies.dynamo_kv import DynamoKV
from dlmix.routing.policies.sglang_cache_aware import SGLangCacheAware, SGLangCacheAwareSmallestTree
from dlmix.routing.prefix_index import PrefixIndex
from dlmix.routing.state import InstanceState, RouteRequest
import dlmix.sim  # noqa: F401  (registers the simulator-only oracle)
from dlmix.routing.policies import POLICIES, make_policy


def insts(n, role="both", bs=16):
    return [InstanceState(id=f"i{k}", url=f"sim://{k}", role=role, block_size=bs, slot=k) for k in range(n)]


def req(n_tokens=64, keys=(), text=None, bs=16):
    r = RouteRequest(prompt_len=n_tokens, block_hashes=lambda b: list(keys))
    if text is not None:
        r.text = text
    return r


def test_registry_has_every_baseline():
    names = set(POLICIES)
    assert {"round_robin", "least_load", "prefix", "cost", "dlrouter_prefix_cache", "dlrouter_min_expected_latency",
            "cache_aware", "cache_aware_smallest_tree", "dynamo_kv", "oracle"} <= names
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("nope")


def test_dlrouter_prefix_cache_one_char_hit_ignores_load():
    s = insts(3)
    v = ClusterView(s)
    p = DLRouterPrefixCache()
    first = p.select(req(text="Abc"), s, v)           # miss: least loaded (all 0) -> round robin from 0
    assert first is s[0]
    s[0].load.inflight = 50                            # heavily loaded
    assert p.select(req(text="Axyz"), s, v) is s[0]    # one matching character is a hit, regardless of load
    assert p.select(req(text="Bq"), s, v) is s[2]      # miss: least in-flight, ties 1 and 2 -> round robin (2nd)
    s[2].load.inflight = 1
    assert p.select(req(text="Cq"), s, v) is s[1]      # miss: only instance 1 has the fewest in flight
    assert p.select(req(text="Bqq"), s, v) is s[2]     # deepest hit: "Bq" recorded for instance 2


def test_dlrouter_min_expected_latency_random_ties_are_seeded():
    s = insts(4)
    for k, l in enumerate([3, 1, 1, 2]):
        s[k].load.inflight = l
    picks = [DLRouterMinExpectedLatency(seed=5).select(req(), s, ClusterView(s)).id for _ in range(3)]
    assert picks[0] in ("i1", "i2") and len(set(picks)) == 1
    p = DLRouterMinExpectedLatency(seed=1)
    seen = {p.select(req(), s, ClusterView(s)).id for _ in range(50)}
    assert seen == {"i1", "i2"}


def test_sglang_cache_aware_thresholds():
    s = insts(2)
    v = ClusterView(s)
    p = SGLangCacheAware(tree_block_size=16)
    keys = list(range(10))
    assert p.select(req(160, keys), s, v) is s[0]      # empty trees, balanced -> least load (tie: index 0)
    s[0].load.inflight = 60
    # balanced (60 - 0 <= 64): match rate 10 blocks * 16 / 160 = 1.0 > 0.3 -> instance 0 despite its load
    assert p.select(req(160, keys), s, v) is s[0]
    s[0].load.inflight = 70                            # 70 - 0 > 64 and 70 > 1.5 * 0: imbalanced -> least load
    assert p.select(req(160, keys), s, v) is s[1]
    s[0].load.inflight = 2
    s[1].load.inflight = 1
    # match rate of an unrelated prompt 0 <= 0.3 -> fallback least load (instance 1)
    assert p.select(req(160, [99, 98]), s, v) is s[1]
    # the smallest-tree variant ignores load: instance 1 holds 10 + 2 entries, instance 0 10
    q = SGLangCacheAwareSmallestTree(tree_block_size=16)
    q._insert(list(range(10)), 0)
    q._insert(list(range(20, 32)), 1)
    assert q.select(req(160, [77]), s, v) is s[0]


def test_dynamo_kv_cost_formula():
    s = insts(2, bs=16)
    idx = PrefixIndex()
    keys = [11, 12, 13, 14]
    idx.store(1, keys[:3])                             # instance 1 caches 3 of the 4 blocks (48 tokens)
    s[0].load.inflight_prefill_tokens = 0
    s[1].load.inflight_prefill_tokens = 32
    s[1].load.decode_ctx_tokens = 64
    v = ClusterView(s, index=idx)
    p = DynamoKV()
    r = req(64, keys)
    c = p.costs(r, s, v, 1.0)
    # inst 0: prefill (0 + 64)/16 = 4, decode (0 + 0 + 64)/16 = 4 -> 8
    # inst 1: prefill (32 + 64 - 48)/16 = 3, decode (64 + 32 + 64)/16 = 10 -> 13
    assert c == [8.0, 13.0]
    assert p.select(r, s, v) is s[0]
    assert DynamoKV(overlap_score_weight=4.0).costs(r, s, v, 4.0) == [20.0, 22.0]


def test_dynamo_kv_disaggregated_decode_ignores_overlap():
    s = insts(2, role="prefill") + [InstanceState(id=f"d{k}", url="x", role="decode", slot=2 + k) for k in range(2)]
    idx = PrefixIndex()
    idx.store(3, [1, 2, 3, 4])
    s[2].load.decode_ctx_tokens = 16
    d = DynamoKV().choose(req(64, [1, 2, 3, 4]), ClusterView(s, index=idx))
    assert d.prefill is not None and d.decode is s[3]  # D: least active blocks (overlap scoring off)


def test_oracle_needs_a_simulator():
    s = insts(1)
    with pytest.raises(RuntimeError, match="simulator"):
        make_policy("oracle").choose(req(), ClusterView(s))
