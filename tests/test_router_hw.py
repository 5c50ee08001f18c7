"""Chip catalog and cost model: required chips with sources, YAML overrides, exact formula values."""
from __future__ import annotations

import pytest

from dlmix.hw.cost import PRESETS, CostModel, ModelSpec, ewma_ratio
from dlmix.hw.profiles import CatalogError, load_catalog

REQUIRED = ["A100", "H100", "H200", "H20", "L20", "RTX4090", "Ascend910B", "K100", "C500", "BI-V150", "MTT-S4000",
            "S60", "BR104", "BR100", "PPU", "cpu-x86"]


def test_catalog_has_required_chips_with_sources():
    cat = load_catalog()
    for n in REQUIRED:
        p = cat.chip(n)
        assert p.bf16_tflops > 0 and p.mem_bw_gbps > 0 and p.mem_gb > 0 and p.source
    assert cat.chip("h100").bf16_tflops == 989 and cat.chip("H100").mem_bw_gbps == 3350
    assert cat.chip("910b").name == "Ascend910B"  # alias, case-insensitive
    assert round(cat.chip("H20").ridge, 1) == 37.0


def test_user_yaml_adds_and_overrides(tmp_path):
    f = tmp_path / "mine.yaml"
    f.write_text("chips:\n  NewChip:\n    bf16_tflops: 100\n    mem_bw_gbps: 1000\n    mem_gb: 32\n    source: bench\n"
                 "  H20:\n    mem_bw_gbps: 3900\n")
    cat = load_catalog([f])
    assert cat.chip("newchip").flops == 100e12
    assert cat.chip("H20").mem_bw_gbps == 3900 and cat.chip("H20").bf16_tflops == 148
    bad = tmp_path / "bad.yaml"
    bad.write_text("chips:\n  X:\n    bf16_tflops: 1\n")
    with pytest.raises(CatalogError, match="lacks mem_bw_gbps, mem_gb"):
        load_catalog([bad])
    with pytest.raises(CatalogError, match="cannot read"):
        load_catalog([tmp_path / "missing.yaml"])


@pytest.mark.parametrize("text,match", [
    ("chips:\n  X:\n    bf16_tflops: 1\n    mem_bw_gbps: 1\n    mem_gb: 1\n    mfuu: 0.3\n", "unknown key"),
    ("chps:\n  X:\n    bf16_tflops: 1\n    mem_bw_gbps: 1\n    mem_gb: 1\n", "unknown top-level"),
    ("links:\n  slow: {bandwidth_gbps: -1}\n", "bandwidth_gbps must be > 0"),
])
def test_catalog_refuses_typos_and_bad_links(tmp_path, text, match):
    """A typo in a chip file was silently ignored (the chip kept the default mfu; a misspelt 'chips' loaded
    nothing) and a link of negative bandwidth was accepted (found by a new-user review)."""
    f = tmp_path / "c.yaml"
    f.write_text(text)
    with pytest.raises(CatalogError, match=match):
        load_catalog([f])


def test_cost_formulas_exact():
    m = ModelSpec(params=8e9, layers=32, q_heads=32, kv_heads=8, head_dim=128, dtype_bytes=2)
    assert m.kv_bytes_per_token == 131072 == 2 * 32 * 8 * 128 * 2
    cm = CostModel(m, t0=0.0, t1=0.0)
    h100 = cm.chip("H100")
    # prefill 2048 uncached: (2P N + 2 L nq d N^2) / (MFU F)
    flops = 2 * 8e9 * 2048 + 2 * 32 * 32 * 128 * 2048 ** 2
    assert cm.prefill_flops(2048) == flops
    assert cm.prefill_time("H100", 2048) == pytest.approx(flops / (0.5 * 989e12))
    # cached prefix only costs the rest
    assert cm.prefill_flops(2048, 1024) == 2 * 8e9 * 1024 + 2 * 32 * 32 * 128 * (2048 ** 2 - 1024 ** 2)
    # decode: memory-bound (weights + KV) at small batch
    t = cm.decode_step_time("H20", 64, 64 * 4096)
    assert t == pytest.approx((8e9 * 2 + 64 * 4096 * 131072) / (0.8 * 4000e9))
    # transfer: 8192 tokens over 25 Gb/s at 80 % + 5 ms setup
    assert cm.transfer_time(8192, "tcp-25g") == pytest.approx(0.005 + 8192 * 131072 / (0.8 * 25e9 / 8))
    assert cm.transfer_time(0, "tcp-25g") == 0.0
    link = cm.link_between({"link": "rdma-100g"}, {"bandwidth_gbps": 25, "setup_ms": 3})
    assert link.bandwidth_gbps == 25 and link.setup_ms == 3
    assert h100.flops == 989e12


def test_model_spec_from_hf_config(smollm2_dir):
    s = ModelSpec.from_hf_config(smollm2_dir)
    assert (s.layers, s.q_heads, s.kv_heads, s.head_dim) == (30, 9, 3, 64)
    assert s.kv_bytes_per_token == 2 * 30 * 3 * 64 * 2 == 23040
    assert abs(s.params - PRESETS["smollm2-135m"].params) / 1.35e8 < 0.05


def test_ewma_ratio():
    assert ewma_ratio(1.0, 2.0, 1.0, alpha=0.5) == 1.5
    assert ewma_ratio(1.0, 0.0, 1.0) == 1.0
    assert ewma_ratio(1.0, 1e6, 1.0, alpha=1.0) == 50.0


def test_one_roofline_shared_by_router_and_simulator():
    """The router's estimates are the two ends of the simulator's iteration roofline; KV capacity is one formula."""
    from dlmix.hw.cost import ChipCost, kv_capacity_bytes
    from dlmix.sim.config import load_deployment
    from dlmix.sim.timing import RooflineTiming

    m = PRESETS["llama-3.1-8b"]
    cat = load_catalog()
    cm = CostModel(m, cat, t0=0.0, t1=0.0)
    for chip, tp in (("H100", 1), ("H20", 2)):
        cc = cm.on(chip, tp)
        assert isinstance(cc, ChipCost) and cc is cm.on(chip, tp)  # memoised
        p = cat.chip(chip)
        assert cc.s_per_flop == 1.0 / (p.mfu * p.flops * tp) and cc.s_per_byte == 1.0 / (p.bw_eff * p.mem_bw * tp)
        # prefill of 8192 tokens (1024 cached) is compute-bound: the iteration's compute term (B = S = 0)
        n, h = 8192, 1024
        assert cm.prefill_time(chip, n, h, tp) == pytest.approx(cc.iteration(n - h, n * n - h * h, 0, 0, 0),
                                                                rel=1e-12)
        # a small decode batch is memory-bound: the iteration's memory term
        assert cm.decode_step_time(chip, 8, 8 * 2048, tp) == pytest.approx(cc.iteration(0, 0, 0, 8, 8 * 2048),
                                                                          rel=1e-12)
        # the simulator's roofline timing is that iteration plus its fixed overhead
        rt = RooflineTiming(p, m, tp, t_step=0.003)
        assert rt.iteration(512, 512 ** 2, 512, 16, 30000) == 0.003 + cc.iteration(512, 512 ** 2, 512, 16, 30000)
        assert cm.kv_capacity_tokens(chip, tp) == int(kv_capacity_bytes(p, m, tp, 0.9) / m.kv_bytes_per_token)
    dep = load_deployment("hetero_pd")
    for spec in dep.instances:
        cap = kv_capacity_bytes(cat.chip(spec.chip), m, spec.num_chips, dep.gpu_memory_utilization)
        assert dep.kv_blocks(spec, m) == int(cap // (spec.block_size * m.kv_bytes_per_token)) > 0


# ---- review 4: a chip file with a NaN figure loaded (`bf16_tflops: .nan`: `dlmix plan` then answered "NO FEASIBLE
# DEPLOYMENT", exit 3; the router's cost policy scored with NaN), an infinite one crashed `dlmix plan` with a
# ZeroDivisionError traceback, and fp16_tflops was not checked at all
@pytest.mark.parametrize("line", ["bf16_tflops: .nan", "mem_bw_gbps: .inf", "mem_gb: .nan",
                                  "fp16_tflops: -5", "fp16_tflops: .nan"])
def test_catalog_refuses_non_finite_and_non_positive_figures(tmp_path, line):
    f = tmp_path / "c.yaml"
    f.write_text("chips:\n  X1:\n    vendor: NVIDIA\n    bf16_tflops: 100\n    mem_bw_gbps: 1000\n    mem_gb: 80\n"
                 f"    {line}\n")
    with pytest.raises(CatalogError, match=r"must be a finite number|figures must be > 0"):
        load_catalog([f])


def test_fp16_tflops_zero_is_refused(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("chips:\n  X1:\n    vendor: NVIDIA\n    bf16_tflops: 100\n    mem_bw_gbps: 1000\n    mem_gb: 80\n"
                 "    fp16_tflops: 0\n")
    with pytest.raises(CatalogError, match="figures must be > 0"):
        load_catalog([f])


def test_fp16_tflops_absent_is_the_bf16_figure(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("chips:\n  X1:\n    vendor: NVIDIA\n    bf16_tflops: 100\n    mem_bw_gbps: 1000\n    mem_gb: 80\n")
    assert load_catalog([f]).chip("X1").fp16_tflops == 100.0
