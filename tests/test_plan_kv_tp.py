"""dlmix plan: KV cache capacity when the TP size exceeds the model's KV heads.

vLLM gives every tensor-parallel rank ``max(1, total_kv_heads // tp)`` KV heads (``vllm/config/model.py``,
``ModelConfig.get_num_kv_heads``): with ``tp > kv_heads`` the heads are replicated, each rank caches one whole head,
and a token takes ``tp · 1 · 2 · layers · head_dim · dtype_bytes`` bytes over the instance, not the model's
``2 · layers · kv_heads · head_dim · dtype_bytes``. The expected numbers below are worked out by hand from that rule
(integer arithmetic), not from dlmix's formulas.
"""
from __future__ import annotations

import pytest

from dlmix.hw.cost import CostModel, ModelSpec
from dlmix.plan.analytic import SLO, estimate_role
from dlmix.plan.inventory import load_inventory
from dlmix.plan.report import launch_deployment
from dlmix.plan.search import Candidate, GroupChoice, Planner
from dlmix.plan.workload import load_plan_workload
from dlmix.sim.config import deployment_from_dict, load_model

# SmolLM2-135M (dlmix preset smollm2-135m): 1.35e8 params, 30 layers, 9 heads, 3 KV heads, head_dim 64, BF16.
# H100 (dlmix/data/chips.yaml): 80 GB, 3350 GB/s, bw_eff 0.8; gpu_memory_utilization 0.9.
SMOL_WEIGHTS = 270_000_000                   # 1.35e8 · 2 bytes
SMOL_HEAD_BPT = 2 * 30 * 64 * 2              # K and V of one KV head, all layers: 7680 bytes per token
H100_FREE_9 = 9 * 72_000_000_000 - SMOL_WEIGHTS   # 0.9 · 80 GB · 9 chips − weights = 647.73e9 bytes


def test_kv_capacity_of_tp_above_kv_heads_counts_the_replicas():
    """SmolLM2 on 9 H100 (TP 9 > 3 KV heads): each rank caches 1 head, 9 · 7680 = 69120 bytes per token over the
    instance, so (648e9 − 0.27e9) / 69120 = 9371093 tokens; the full-model 23040 bytes would give 28113281 (3×)."""
    smol = load_model("smollm2")
    assert (smol.layers, smol.kv_heads, smol.head_dim) == (30, 3, 64)
    cost = CostModel(smol)
    assert cost.kv_capacity_tokens("H100", 9) == H100_FREE_9 // (9 * SMOL_HEAD_BPT) == 9371093
    # TP 1 and TP 3 split the 3 heads exactly: unchanged
    assert cost.kv_capacity_tokens("H100", 1) == (72_000_000_000 - SMOL_WEIGHTS) // (3 * SMOL_HEAD_BPT) == 3113281
    assert cost.kv_capacity_tokens("H100", 3) == (3 * 72_000_000_000 - SMOL_WEIGHTS) // (3 * SMOL_HEAD_BPT) == 9363281
    # the planner's analytic estimate reports (and checks the workload against) the same capacity
    wl = load_plan_workload("synthetic:groups=2,per_group=4,prefix=512,suffix=128,output=64", 8)
    e = estimate_role(cost, wl, SLO(5.0, 0.05, 80), "H100", 9, "decode")
    assert e.figures["kv_capacity_tokens"] == 9371093
    # a decode step reads each rank's own head copy: 69120 bytes per context token at 9 · 0.8 · 3350 GB/s
    assert cost.on("H100", 9).kv_s == pytest.approx(9 * SMOL_HEAD_BPT / (9 * 0.8 * 3350e9), rel=1e-12)
    # a CPU instance of 4 cores is one engine at TP 1: its 3 heads are not replicated
    assert cost.kv_capacity_tokens("cpu-x86", 4) == (4 * 230_400_000_000 - SMOL_WEIGHTS) // (3 * SMOL_HEAD_BPT)


def test_simulated_kv_blocks_of_tp_above_kv_heads():
    """The planner's simulations size KV the same way: 647.73e9 / (64 tokens · 69120 bytes) = 146423 blocks."""
    dep = deployment_from_dict({"name": "x", "block_size": 64,
                                "instances": [{"chip": "H100", "count": 1, "role": "both", "num_chips": 9}]})
    assert dep.kv_blocks(dep.instances[0], load_model("smollm2")) == H100_FREE_9 // (64 * 9 * SMOL_HEAD_BPT) == 146423


# A 2-KV-head model whose weights nearly fill 4 H100s: 138e9 params, 80 layers, 64 heads, 2 KV heads, head_dim 128.
# TP 4 > 2 KV heads: each rank caches 1 head, 4 · (2 · 80 · 128 · 2) = 163840 bytes per token over the instance;
# free KV memory 4 · 72e9 − 276e9 = 12e9 bytes -> 73242 tokens (the full-model 81920 bytes would give 146484).
TIGHT = ModelSpec(138e9, 80, 64, 2, 128, 2, "tight-2kv", 131072)


def test_launch_max_model_len_and_memory_fit_of_tp_above_kv_heads():
    assert 4 in TIGHT.allowed_tp_sizes()
    inv = load_inventory("h100x4_h20x4")
    wl = load_plan_workload("synthetic:groups=2,per_group=4,prefix=66000,suffix=1000,output=128", 8)  # 67128 tokens
    pl = Planner(inv, TIGHT, SLO(60.0, 1.0, 80), wl)
    assert pl.cost.kv_capacity_tokens("H100", 4) == 12_000_000_000 // 163840 == 73242
    # the launch file's max_model_len (the power of two 131072 covering 67128 tokens) is capped at what each rank
    # holds: vLLM refuses to start an engine whose KV cache cannot hold one max_model_len sequence
    ld = launch_deployment(pl, Candidate((GroupChoice("H100", "both", 4, 1),)))
    assert [i["max_model_len"] for i in ld["instances"]] == [73242]
    # 81128-token requests do not fit TP 4's 73242 tokens: the memory check must reject the instance
    big = load_plan_workload("synthetic:groups=2,per_group=4,prefix=80000,suffix=1000,output=128", 8)
    e = estimate_role(CostModel(TIGHT), big, SLO(60.0, 1.0, 80), "H100", 4, "decode")
    assert not e.ok and e.reason.startswith("memory") and "holds 73242 tokens" in e.reason
