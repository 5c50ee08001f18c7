"""KV conversion between layouts: property tests against the per-token oracle, sentinel checks, wire form."""

from __future__ import annotations

import math
from contextlib import contextmanager

import pytest

torch = pytest.importorskip("torch")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from dlmix.kv import (  # noqa: E402
    ARRANGEMENTS,
    KVLayout,
    ModelIdentity,
    allocate,
    cast_plane,
    convert,
    convert_from_ranks,
    pack,
    plan_heads,
    read_kv,
    unpack,
    wire_chunks,
    write_kv,
)
from dlmix.kv import ops  # noqa: E402
from dlmix.kv import cells as kv_cells  # noqa: E402
from dlmix.kv import plan as kv_plan  # noqa: E402

MHA_ARRS = [a for a in ARRANGEMENTS if a != "mla"]
DTYPES = ["fp32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2"]
SENTINEL = 7.0  # exactly representable in every dtype


@contextmanager
def chunk_bytes(n: int, direct: bool = False):
    """Force small scratch chunks (``n`` bytes) and choose the CPU per-segment ``copy_`` path or the
    gather/scatter path, so both code paths and their chunk edges are exercised (direct: cells of any size take the
    ``numpy.take`` cell path too)."""
    old = dict(kv_plan.CHUNK_BYTES)
    old_direct = kv_plan.DIRECT_MIN_BYTES
    old_cell = kv_cells.MIN_CELL_BYTES
    kv_plan.CHUNK_BYTES.update(cpu=n, cuda=n)
    kv_plan.DIRECT_MIN_BYTES = 0 if direct else 1 << 62
    kv_cells.MIN_CELL_BYTES = 1 if direct else old_cell
    try:
        yield
    finally:
        kv_plan.CHUNK_BYTES.clear()
        kv_plan.CHUNK_BYTES.update(old)
        kv_plan.DIRECT_MIN_BYTES = old_direct
        kv_cells.MIN_CELL_BYTES = old_cell


def tensors(caches):
    for c in caches:
        yield from (c if isinstance(c, tuple) else (c,))


def fill_random(layout: KVLayout, caches, gen: torch.Generator) -> None:
    for t in tensors(caches):
        vals = torch.randn(t.shape, generator=gen) * 2.0
        t.copy_(vals.to(ops.torch_dtype(layout)).view(t.dtype))


def snapshot(caches) -> list[torch.Tensor]:
    return [t.clone() for t in tensors(caches)]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def rel_tol(dtype: str) -> float:
    return {"fp32": 0.0, "bf16": 2**-8, "fp16": 2**-11, "fp8_e4m3": 2**-4, "fp8_e5m2": 2**-3}[dtype]


def expected_after(dst: KVLayout, before: list[torch.Tensor], dst_bids, skip: int, n: int, truth) -> list:
    """Oracle: the destination caches as they must be: ``before`` plus ``truth(token, layer)`` written per token."""
    exp = [t.clone() for t in before]
    # rebuild the per-layer structure of the cache list
    it = iter(exp)
    caches = [(next(it), next(it)) if dst.separate_kv else next(it) for _ in range(dst.model.num_layers)]
    for layer in range(dst.model.num_layers):
        for tok in range(skip, n):
            k, v = truth(tok, layer)
            write_kv(dst, caches, dst_bids, tok, layer, k, v)
    return list(tensors(caches))


@st.composite
def scenario(draw: st.DrawFn, mla: bool = False):
    if mla:
        model = ModelIdentity("DeepseekV2", draw(st.integers(1, 2)), 1, 12, "mla", 8, 4)
        sa = da = "mla"
    else:
        model = ModelIdentity("Llama", draw(st.integers(1, 2)), draw(st.sampled_from([1, 2, 4])),
                              draw(st.sampled_from([4, 8])), "gqa")
        sa, da = draw(st.sampled_from(MHA_ARRS)), draw(st.sampled_from(MHA_ARRS))

    def lay(arr: str) -> KVLayout:
        bs = draw(st.sampled_from([32, 64])) if arr == "vllm_cpu" else draw(st.sampled_from([1, 3, 4, 16, 32]))
        dt = draw(st.sampled_from(DTYPES))
        fp8 = dt.startswith("fp8")
        ks = draw(st.sampled_from([1.0, 0.5, 2.0])) if fp8 else 1.0
        vs = draw(st.sampled_from([1.0, 0.25])) if fp8 else 1.0
        if mla:
            tps = [1, 2]
        else:
            tps = [t for t in (1, 2, 4) if model.num_kv_heads % t == 0 or t % model.num_kv_heads == 0]
            if arr.startswith("lmdeploy"):  # LMDeploy does not replicate KV heads
                tps = [t for t in tps if t <= model.num_kv_heads]
        tp = draw(st.sampled_from(tps))
        return KVLayout(model, bs, dt, arr, tp, 0, ks, vs)

    src, dst = lay(sa), lay(da)
    dst = dst.with_rank(draw(st.integers(0, dst.tp_size - 1)))
    n = draw(st.integers(1, 70))
    skip = draw(st.integers(0, n))
    sblocks = math.ceil(n / src.block_size)
    dblocks = math.ceil(n / dst.block_size)
    spool = sblocks + draw(st.integers(0, 3))
    dpool = dblocks + draw(st.integers(0, 3))
    sbids = draw(st.permutations(range(spool)))[:sblocks]
    dbids = draw(st.permutations(range(dpool)))[:dblocks]
    seed = draw(st.integers(0, 2**31 - 1))
    chunk = draw(st.sampled_from([64, 1024, 4 << 20]))
    uint8 = draw(st.booleans())
    direct = draw(st.booleans())
    return src, dst, n, skip, spool, dpool, sbids, dbids, seed, chunk, uint8, direct


def run_scenario(sc) -> None:
    src, dst, n, skip, spool, dpool, sbids, dbids, seed, chunk, uint8, direct = sc
    gen = torch.Generator().manual_seed(seed)
    # every source rank, each filled with its own random values (garbage outside the request blocks too)
    sources = []
    for r in range(src.tp_size):
        lay = src.with_rank(r)
        caches = allocate(lay, spool, storage_uint8=uint8)
        fill_random(lay, caches, gen)
        sources.append((lay, caches, sbids))
    dst_caches = allocate(dst, dpool, fill=SENTINEL, storage_uint8=uint8)
    before = snapshot(dst_caches)
    plan = plan_heads([s[0] for s in sources], dst)
    owner = {h: i for i, hs in plan for h in hs}
    dheads = dst.heads_for_rank()

    def truth(tok: int, layer: int):
        ks, vs = [], []
        for h in dheads:
            lay, caches, bids = sources[owner[h]]
            k, v = read_kv(lay, caches, bids, tok, layer)
            i = lay.heads_for_rank().index(h)
            ks.append(cast_plane(k[i:i + 1], lay, dst, 0))
            if v is not None:
                vs.append(cast_plane(v[i:i + 1], lay, dst, 1))
        return torch.cat(ks), (torch.cat(vs) if vs else None)

    with chunk_bytes(chunk, direct):
        written = convert_from_ranks(sources, dst, dst_caches, dbids, n, skip)
    assert written == dst.wire_bytes(n - skip)
    exp = expected_after(dst, before, dbids, skip, n, truth)
    after = list(tensors(dst_caches))
    for e, a in zip(exp, after):
        assert torch.equal(bits(e), bits(a)), "destination differs from the per-token oracle (or wrote outside)"

    # values read back equal the source values within the cast's rounding
    for layer in range(dst.model.num_layers):
        for tok in range(skip, n):
            got = read_kv(dst, dst_caches, dbids, tok, layer, dequantize=True)
            for p, g in enumerate(got):
                if g is None:
                    continue
                for j, h in enumerate(dheads):
                    lay, caches, bids = sources[owner[h]]
                    ref = read_kv(lay, caches, bids, tok, layer, dequantize=True)[p][lay.heads_for_rank().index(h)]
                    tol = max(rel_tol(dst.dtype), 0.0)
                    scale = (dst.k_scale if p == 0 else dst.v_scale) if dst.is_fp8 else 1.0
                    atol = 2**-6 * scale if dst.is_fp8 else 1e-4 * (dst.dtype == "fp16")
                    assert torch.allclose(g[j], ref, rtol=tol, atol=atol), (tok, layer, h, p)

    # convert once per source rank (the per-pair API) writes exactly the same bytes
    dst3 = allocate(dst, dpool, fill=SENTINEL, storage_uint8=uint8)
    with chunk_bytes(chunk, not direct):
        for i, hs in plan:
            lay, caches, bids = sources[i]
            convert(lay, caches, bids, dst, dst3, dbids, n, skip, heads=hs)
    for e, a in zip(after, tensors(dst3)):
        assert torch.equal(bits(e), bits(a)), "per-rank convert differs from convert_from_ranks"

    # the wire form, streamed in small chunks, writes exactly the same bytes
    dst2 = allocate(dst, dpool, fill=SENTINEL, storage_uint8=uint8)
    with chunk_bytes(chunk, direct):
        for i, hs in plan:
            lay, caches, bids = sources[i]
            budget = max(dst.wire_bytes(1, hs), dst.wire_bytes(7, hs))
            staging = torch.empty(budget, dtype=torch.uint8)
            for a, b in wire_chunks(dst, skip, n, budget, hs):
                w = pack(lay, caches, bids, dst, a, b, heads=hs, out=staging)
                assert w.numel() == dst.wire_bytes(b - a, hs) <= budget
                assert unpack(dst, dst2, dbids, w, a, b, heads=hs) == w.numel()
    for e, a in zip(after, tensors(dst2)):
        assert torch.equal(bits(e), bits(a)), "pack/unpack differs from convert"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario())
def test_convert_any_pair_matches_oracle(sc) -> None:
    run_scenario(sc)


@st.composite
def same_block_scenario(draw: st.DrawFn):
    """Equal block size and dtype on both sides (the CPU whole-block ``index_select`` path when direct), any
    arrangements and TP sizes, shuffled ids in pools with spare blocks, usually several full blocks."""
    model = ModelIdentity("Llama", draw(st.integers(1, 2)), draw(st.sampled_from([2, 4])),
                          draw(st.sampled_from([4, 8])), "gqa")
    sa, da = draw(st.sampled_from(MHA_ARRS)), draw(st.sampled_from(MHA_ARRS))
    bs = draw(st.sampled_from([32, 64])) if "vllm_cpu" in (sa, da) else draw(st.sampled_from([1, 3, 4, 16]))
    dt = draw(st.sampled_from(DTYPES))
    ks = draw(st.sampled_from([1.0, 0.5])) if dt.startswith("fp8") else 1.0

    def lay(arr: str) -> KVLayout:
        tps = [t for t in (1, 2, 4) if t <= model.num_kv_heads or not arr.startswith("lmdeploy")]
        return KVLayout(model, bs, dt, arr, draw(st.sampled_from(tps)), 0, ks, 1.0)

    src, dst = lay(sa), lay(da)
    dst = dst.with_rank(draw(st.integers(0, dst.tp_size - 1)))
    n = draw(st.integers(1, 4 * bs + 5))
    skip = draw(st.integers(0, n))
    blocks = math.ceil(n / bs)
    spool, dpool = blocks + draw(st.integers(0, 3)), blocks + draw(st.integers(0, 3))
    sbids = draw(st.permutations(range(spool)))[:blocks]
    dbids = draw(st.permutations(range(dpool)))[:blocks]
    return (src, dst, n, skip, spool, dpool, sbids, dbids, draw(st.integers(0, 2**31 - 1)),
            draw(st.sampled_from([64, 4 << 20])), draw(st.booleans()), draw(st.booleans()))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(same_block_scenario())
def test_convert_equal_block_sizes_matches_oracle(sc) -> None:
    run_scenario(sc)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario(mla=True))
def test_convert_mla_latent(sc) -> None:
    run_scenario(sc)


@pytest.mark.parametrize("src_tp,dst_tp,heads", [(2, 1, 4), (2, 4, 4), (4, 2, 2), (1, 4, 2), (2, 4, 1)])
def test_tp_resharding_against_global_truth(src_tp: int, dst_tp: int, heads: int) -> None:
    """Prefill at TP=src_tp, decode at TP=dst_tp: every decode rank reads the model's true K/V of its heads."""
    model = ModelIdentity("Llama", 2, heads, 8)
    n, bs_s, bs_d = 45, 16, 32
    gen = torch.Generator().manual_seed(1)
    truth_k = torch.randn(2, n, heads, 8, generator=gen)
    truth_v = torch.randn(2, n, heads, 8, generator=gen)
    src = [KVLayout(model, bs_s, "fp32", "vllm_flash_nhd", src_tp, r) for r in range(src_tp)]
    sb = [5, 0, 3]
    sources = []
    for lay in src:
        c = allocate(lay, 6, fill=-1.0)
        hs = list(lay.heads_for_rank())
        for layer in range(2):
            for t in range(n):
                write_kv(lay, c, sb, t, layer, truth_k[layer, t, hs], truth_v[layer, t, hs])
        sources.append((lay, c, sb))
    for r in range(dst_tp):
        dst = KVLayout(model, bs_d, "bf16", "vllm_cpu", dst_tp, r)
        dc = allocate(dst, 4, fill=SENTINEL)
        db = [2, 0]
        convert_from_ranks(sources, dst, dc, db, n, skip_tokens=9)
        hs = list(dst.heads_for_rank())
        for layer in range(2):
            for t in range(n):
                k, v = read_kv(dst, dc, db, t, layer)
                if t < 9:
                    assert (k.float() == SENTINEL).all() and (v.float() == SENTINEL).all()
                else:
                    assert torch.equal(k, truth_k[layer, t, hs].to(torch.bfloat16))
                    assert torch.equal(v, truth_v[layer, t, hs].to(torch.bfloat16))
        # blocks outside the request (1, 3) keep the sentinel
        for blk in (1, 3):
            assert (dc[0][blk].float() == SENTINEL).all()


def test_incompatible_pairs_refused() -> None:
    pre = KVLayout(ModelIdentity("Llama", 2, 4, 8), 16, "bf16", "vllm_flash_nhd")
    dec = KVLayout(ModelIdentity("Llama", 2, 8, 8), 32, "bf16", "vllm_cpu")
    sc, dc = allocate(pre, 4), allocate(dec, 4, fill=SENTINEL)
    with pytest.raises(ValueError, match="decode has 8 KV heads, prefill 4: different models"):
        convert(pre, sc, [0, 1], dec, dc, [0], 20)
    with pytest.raises(ValueError, match="different models"):
        pack(pre, sc, [0, 1], dec, 0, 20)
    assert all((t.float() == SENTINEL).all() for t in tensors(dc))
    # fingerprints: refused unless relaxed (negative control only)
    a = KVLayout(ModelIdentity("Llama", 1, 2, 8, weights_fingerprint="A"), 4, "fp32", "lmdeploy")
    b = KVLayout(ModelIdentity("Llama", 1, 2, 8, weights_fingerprint="B"), 4, "fp32", "lmdeploy")
    ac, bc = allocate(a, 2, fill=1.0), allocate(b, 2, fill=0.0)
    with pytest.raises(ValueError, match="fingerprint"):
        convert(a, ac, [0], b, bc, [1], 4)
    assert convert(a, ac, [0], b, bc, [1], 4, relax_fingerprint=True) == 4 * 2 * 2 * 8 * 4
    assert (bc[0][0][1] == 1.0).all() and (bc[0][0][0] == 0.0).all()


def test_bad_inputs_give_clear_errors() -> None:
    m = ModelIdentity("Llama", 2, 2, 8)
    s = KVLayout(m, 4, "fp32", "lmdeploy")
    d = KVLayout(m, 4, "fp32", "vllm_flash_nhd")
    sc, dc = allocate(s, 4), allocate(d, 4)
    with pytest.raises(ValueError, match="need 3"):
        convert(s, sc, [0, 1], d, dc, [0, 1, 2], 10)
    with pytest.raises(ValueError, match=r"0\.\.3"):
        convert(s, sc, [0, 1, 9], d, dc, [0, 1, 2], 10)
    with pytest.raises(ValueError, match="repeats"):
        convert(s, sc, [0, 1, 2], d, dc, [0, 1, 1], 10)
    with pytest.raises(ValueError, match="skip_tokens"):
        convert(s, sc, [0, 1, 2], d, dc, [0, 1, 2], 10, skip_tokens=11)
    with pytest.raises(ValueError, match=r"\(K, V\) tuple"):
        convert(s, [t[0] for t in sc], [0, 1, 2], d, dc, [0, 1, 2], 10)
    with pytest.raises(ValueError, match="dtype"):
        convert(s, sc, [0], d, [t.half() for t in dc], [0], 4)
    with pytest.raises(ValueError, match="2 per-layer"):
        convert(s, sc[:1], [0], d, dc, [0], 4)
    with pytest.raises(ValueError, match="wire buffer must be"):
        unpack(d, dc, [0], torch.zeros(5, dtype=torch.uint8), 0, 4)
    tp2 = KVLayout(m, 4, "fp32", "lmdeploy", tp_size=2, tp_rank=1)
    with pytest.raises(ValueError, match="needs KV heads"):
        convert_from_ranks([(tp2, allocate(tp2, 4), [0])], d, dc, [0], 4)
    with pytest.raises(ValueError, match="one token needs"):
        wire_chunks(d, 0, 10, 16)


def test_wire_order_is_canonical() -> None:
    """Wire = [layers, planes(K, V), tokens, heads, head_size] in the destination dtype."""
    m = ModelIdentity("Llama", 2, 2, 4)
    s = KVLayout(m, 4, "fp32", "vllm_flash_hnd")
    d = KVLayout(m, 8, "fp16", "sglang_nhd")
    sc = allocate(s, 3)
    bids = [2, 0]
    for layer in range(2):
        for t in range(8):
            k = torch.tensor([[1000 * layer + 10 * t + h + 0.0] * 4 for h in range(2)])
            write_kv(s, sc, bids, t, layer, k, -k)
    w = pack(s, sc, bids, d, 3, 7)
    assert w.numel() == d.wire_bytes(4) == 2 * 2 * 4 * 2 * 4 * 2
    arr = w.view(torch.float16).view(2, 2, 4, 2, 4)
    for layer in range(2):
        for i, t in enumerate(range(3, 7)):
            for h in range(2):
                assert (arr[layer, 0, i, h] == 1000 * layer + 10 * t + h).all()
                assert (arr[layer, 1, i, h] == -(1000 * layer + 10 * t + h)).all()
    # unpack from plain bytes (what a socket delivers)
    dc = allocate(d, 4, fill=SENTINEL)
    unpack(d, dc, [3, 1], bytes(w.numpy().tobytes()), 3, 7)
    k, v = read_kv(d, dc, [3, 1], 5, 1)
    assert (k[:, 0] == torch.tensor([1050.0, 1051.0], dtype=torch.float16)).all()
    assert (read_kv(d, dc, [3, 1], 2, 1)[0] == SENTINEL).all()


def test_fp8_scales_round_trip() -> None:
    m = ModelIdentity("Llama", 1, 1, 4)
    src = KVLayout(m, 4, "fp32", "lmdeploy")
    dst = KVLayout(m, 4, "fp8_e4m3", "vllm_flash_nhd", k_scale=0.5, v_scale=4.0)
    sc = allocate(src, 1)
    write_kv(src, sc, [0], 0, 0, torch.tensor([[1.0, -2.0, 0.75, 1000.0]]), torch.tensor([[8.0, 16.0, -4.0, 1.0]]))
    dc = allocate(dst, 1, storage_uint8=True)
    convert(src, sc, [0], dst, dc, [0], 1)
    k, v = read_kv(dst, dc, [0], 0, 0)
    # stored = x / scale, saturated to the e4m3 maximum 448
    assert k.float().tolist() == [[2.0, -4.0, 1.5, 448.0]]
    assert v.float().tolist() == [[2.0, 4.0, -1.0, 0.25]]
    kd, vd = read_kv(dst, dc, [0], 0, 0, dequantize=True)
    assert kd.tolist() == [[1.0, -2.0, 0.75, 224.0]] and vd.tolist() == [[8.0, 16.0, -4.0, 1.0]]
    # back to bf16 with the fp8 scale applied
    back = KVLayout(m, 2, "bf16", "sglang_hnd")
    bc = allocate(back, 2)
    convert(dst, dc, [0], back, bc, [1, 0], 1)
    assert read_kv(back, bc, [1, 0], 0, 0)[1].float().tolist() == [[8.0, 16.0, -4.0, 1.0]]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_convert_on_cuda_matches_cpu() -> None:
    m = ModelIdentity("Llama", 2, 4, 16)
    src = KVLayout(m, 16, "bf16", "vllm_flash_nhd", 2, 0)
    dst = KVLayout(m, 32, "fp8_e4m3", "vllm_flashinfer_hnd", 1, 0, k_scale=0.5)
    gen = torch.Generator().manual_seed(3)
    sources_cpu, sources_gpu = [], []
    for r in range(2):
        lay = src.with_rank(r)
        c = allocate(lay, 10)
        fill_random(lay, c, gen)
        sources_cpu.append((lay, c, [9, 2, 4, 7, 1]))
        sources_gpu.append((lay, [t.cuda() for t in c], [9, 2, 4, 7, 1]))
    dcpu = allocate(dst, 5, fill=SENTINEL)
    dgpu = [t.cuda() for t in allocate(dst, 5, fill=SENTINEL)]
    convert_from_ranks(sources_cpu, dst, dcpu, [4, 0, 2], 77, 13)
    convert_from_ranks(sources_gpu, dst, dgpu, [4, 0, 2], 77, 13)
    for a, b in zip(dcpu, dgpu):
        assert torch.equal(bits(a), bits(b.cpu()))


def test_plan_heads_replication_and_split() -> None:
    m = ModelIdentity("Llama", 1, 2, 8)
    prefill_tp4 = [KVLayout(m, 16, "bf16", "vllm_flash_nhd", 4, r) for r in range(4)]  # heads 0,0,1,1
    assert plan_heads(prefill_tp4, KVLayout(m, 16, "bf16", "lmdeploy")) == \
        [(0, (0,)), (2, (1,))]
    m8 = ModelIdentity("Llama", 1, 8, 8)
    tp2 = [KVLayout(m8, 16, "bf16", "vllm_flash_nhd", 2, r) for r in range(2)]
    assert plan_heads(tp2, KVLayout(m8, 32, "fp32", "lmdeploy")) == [(0, (0, 1, 2, 3)), (1, (4, 5, 6, 7))]
    assert plan_heads(tp2, KVLayout(m8, 32, "fp32", "lmdeploy", 4, 3)) == [(1, (6, 7))]
    # a subset of ranks suffices when it covers the destination's heads
    assert plan_heads(tp2[1:], KVLayout(m8, 32, "fp32", "lmdeploy", 4, 2)) == [(0, (4, 5))]


@pytest.mark.parametrize("direct", [True, False])
def test_strided_engine_tensors_blnhc(direct: bool) -> None:
    """vLLM 0.32 ``BLNHC``: one buffer ``[B, L, N, H, 2D]``, per-layer views ``buf[:, l]`` whose block stride spans
    all layers. Conversion reads and writes such views in place (no hidden copies)."""
    m = ModelIdentity("Llama", 3, 2, 8)
    lay = KVLayout(m, 4, "bf16", "vllm_lbnhc")
    gen = torch.Generator().manual_seed(5)
    buf = (torch.randn(6, 3, 4, 2, 16, generator=gen)).to(torch.bfloat16)
    src = [buf[:, layer] for layer in range(3)]
    assert not src[0].is_contiguous()
    mid = KVLayout(m, 8, "fp32", "lmdeploy")
    mc = allocate(mid, 3, fill=SENTINEL)
    back_buf = torch.full((6, 3, 4, 2, 16), SENTINEL, dtype=torch.bfloat16)
    back = [back_buf[:, layer] for layer in range(3)]
    sb, mb, bb = [4, 0, 5, 2], [2, 0], [1, 3, 0, 5]
    with chunk_bytes(64, direct):
        convert(lay, src, sb, mid, mc, mb, 15, 2)
        convert(mid, mc, mb, lay, back, bb, 15, 2)
    for layer in range(3):
        for t in range(15):
            k0, v0 = read_kv(lay, src, sb, t, layer)
            k1, v1 = read_kv(lay, back, bb, t, layer)
            km, _ = read_kv(mid, mc, mb, t, layer)
            if t < 2:
                assert (k1.float() == SENTINEL).all() and (km == SENTINEL).all()
            else:
                assert torch.equal(k0, k1) and torch.equal(v0, v1) and torch.equal(km, k0.float())
    # blocks outside the request and the 16th slot of the last block keep the sentinel
    assert (back_buf[[2, 4]].float() == SENTINEL).all()
    assert (back_buf[5, :, 3].float() == SENTINEL).all()


@pytest.mark.parametrize("same", [True, False])
def test_later_layer_with_fewer_blocks_refused(same: bool) -> None:
    """Block ids are checked against layer 0; a later layer holding fewer blocks must raise ValueError (the CPU
    whole-block paths move raw memory), whether the layouts are identical (memmove) or only block sizes match."""
    m = ModelIdentity("Llama", 3, 2, 128)
    src = KVLayout(m, 32, "bf16", "vllm_flash_nhd")
    dst = src if same else KVLayout(m, 32, "bf16", "vllm_flashinfer_nhd")
    sc = allocate(src, 4)
    dc = allocate(dst, 4, fill=SENTINEL)
    dc[2] = allocate(dst, 2, fill=SENTINEL)[2]
    before = snapshot(dc)
    with pytest.raises(ValueError, match="destination layer 2 cache holds 2 blocks"):
        convert(src, sc, [0, 1, 2, 3], dst, dc, [3, 2, 1, 0], 128)
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(dc))), "nothing written before the error"


def test_pack_unpack_refuse_short_later_layer() -> None:
    """The wire path checks every layer's cache against the block table too (ValueError, nothing written)."""
    m = ModelIdentity("Llama", 3, 2, 128)
    lay = KVLayout(m, 32, "bf16", "vllm_flash_nhd")
    sc = allocate(lay, 4)
    wire = pack(lay, sc, [0, 1], lay, 0, 64)
    short = list(sc)
    short[1] = allocate(lay, 1)[1]
    with pytest.raises(ValueError, match="source layer 1 cache holds 1 blocks"):
        pack(lay, short, [0, 1], lay, 0, 64)
    dc = allocate(lay, 4, fill=SENTINEL)
    dc[2] = allocate(lay, 1, fill=SENTINEL)[2]
    before = snapshot(dc)
    with pytest.raises(ValueError, match="destination layer 2 cache holds 1 blocks"):
        unpack(lay, dc, [3, 2], wire, 0, 64)
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(dc)))


@pytest.mark.parametrize("src_arr,dst_arr,ns,nd,dtype", [
    ("vllm_flash_nhd", "vllm_flash_hnd", 32, 32, "bf16"),
    ("vllm_flash_hnd", "vllm_flash_nhd", 32, 32, "fp16"),
    ("vllm_cpu", "vllm_cpu", 32, 64, "bf16"),
    ("vllm_cpu", "vllm_cpu", 64, 32, "fp8_e4m3"),
    ("sglang_hnd", "vllm_flash_hnd", 64, 32, "bf16"),
    ("vllm_flashinfer_hnd", "vllm_lbnhc", 32, 16, "fp32"),
])
def test_cell_path_is_taken_and_exact(monkeypatch: pytest.MonkeyPatch, src_arr: str, dst_arr: str, ns: int,
                                      nd: int, dtype: str) -> None:
    """Re-arrangements between non-token-row layouts at realistic sizes go through the ``numpy.take`` cell path
    (default thresholds), write exactly the source values and nothing outside the requested tokens."""
    used = []
    real = kv_cells.plan_cells

    def spy(*a, **k):
        p = real(*a, **k)
        used.append(p is not None)
        return p

    monkeypatch.setattr(kv_cells, "plan_cells", spy)
    model = ModelIdentity("Llama", 2, 8, 128, "gqa")  # blocks of >= DIRECT_MIN_BYTES per plane
    src = KVLayout(model, ns, dtype, src_arr, k_scale=0.5 if dtype.startswith("fp8") else 1.0)
    dst = KVLayout(model, nd, dtype, dst_arr, k_scale=0.5 if dtype.startswith("fp8") else 1.0)
    n, skip = 5 * max(ns, nd) + 7, 3
    sb = [(i * 7 + 3) % (n // ns + 4) for i in range(-(-n // ns))]
    db = [(i * 5 + 1) % (n // nd + 4) for i in range(-(-n // nd))]
    sc, dc = allocate(src, n // ns + 4), allocate(dst, n // nd + 4, fill=SENTINEL)
    fill_random(src, sc, torch.Generator().manual_seed(3))
    before = snapshot(dc)
    convert(src, sc, sb, dst, dc, db, n, skip)
    assert used == [True]

    def truth(tok, layer):
        return read_kv(src, sc, sb, tok, layer)

    for got, want in zip(snapshot(dc), expected_after(dst, before, db, skip, n, truth)):
        assert torch.equal(bits(got), bits(want))


@contextmanager
def rows_on_cpu():
    """Make the CPU take the row path (:mod:`dlmix.kv.rows`, the path CUDA takes) wherever it applies."""
    old = kv_plan.ROWS_ON_CPU
    kv_plan.ROWS_ON_CPU = True
    try:
        yield
    finally:
        kv_plan.ROWS_ON_CPU = old


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario())
def test_row_path_any_pair_matches_oracle(sc) -> None:
    """The accelerator row path, run on the CPU, against the per-token oracle (every arrangement pair, dtypes with
    fp8 scales, block sizes, TP re-sharding, skip tokens, chunk edges)."""
    with rows_on_cpu():
        run_scenario(sc)


def test_row_path_is_taken_where_it_applies(monkeypatch: pytest.MonkeyPatch) -> None:
    """The row path runs (and writes exactly) for row-contiguous arrangements; vLLM CPU's transposed K falls back
    to the chunked path."""
    from dlmix.kv import rows as kv_rows

    calls = []
    real = kv_rows._transfer_rows

    def spy(*a, **k):
        calls.append(real(*a, **k))
        return calls[-1]

    import dlmix.kv.transfer as kv_transfer
    monkeypatch.setattr(kv_transfer, "_transfer_rows", spy)
    m = ModelIdentity("Llama", 2, 4, 16)
    gen = torch.Generator().manual_seed(5)
    for sa, da, ns, taken in [("vllm_flash_nhd", "sglang_hnd", 16, True), ("lmdeploy", "vllm_flashinfer_hnd", 16, True),
                              ("vllm_cpu", "vllm_flash_nhd", 32, False)]:
        src, dst = KVLayout(m, ns, "bf16", sa), KVLayout(m, 32, "fp16", da)
        sc = allocate(src, 8)
        fill_random(src, sc, gen)
        ref = allocate(dst, 6, fill=SENTINEL)
        convert(src, sc, [5, 1, 7, 2, 0], dst, ref, [3, 0, 4], 77, 9)
        got = allocate(dst, 6, fill=SENTINEL)
        calls.clear()
        with rows_on_cpu():
            convert(src, sc, [5, 1, 7, 2, 0], dst, got, [3, 0, 4], 77, 9)
        assert calls == [taken], (sa, da)
        for a, b in zip(tensors(ref), tensors(got)):
            assert torch.equal(bits(a), bits(b)), (sa, da)


def allocate_shared(layout: KVLayout, num_blocks: int) -> list:
    """Per-layer caches that are views of ONE buffer, as vLLM's workers and a transport's staging region hold them
    (every layer, and K/V, in one storage): the caches the fused row path moves in one gather and one scatter."""
    return allocate(layout, num_blocks, fill=SENTINEL, one_buffer=True)


@pytest.mark.parametrize("case", ["reblock_cast", "fp8_scales", "tp2_to_1", "same"])
@pytest.mark.parametrize("sa", [a for a in MHA_ARRS if a != "vllm_cpu"])
def test_fused_row_path_on_shared_buffers_matches_separate_caches(monkeypatch: pytest.MonkeyPatch, sa: str,
                                                                 case: str) -> None:
    """Source and destination caches that are views of one buffer each take the fused row path (every layer plane
    in one gather and one scatter per chunk); the destination bytes equal those of the same conversion between
    separately allocated caches (the chunked path), for every destination arrangement, with skipped tokens and
    small chunks (several chunk edges)."""
    from dlmix.kv import rows as kv_rows

    fused_calls = []
    real = kv_rows._move_fused
    monkeypatch.setattr(kv_rows, "_move_fused", lambda *a, **k: (fused_calls.append(1), real(*a, **k))[1])
    m = ModelIdentity("Llama", 3, 4, 16)
    gen = torch.Generator().manual_seed(11)
    for da in [a for a in MHA_ARRS if a != "vllm_cpu"]:
        tp = 2 if case == "tp2_to_1" else 1
        dt = {"reblock_cast": "fp32", "fp8_scales": "fp8_e4m3"}.get(case, "bf16")
        nd = 32 if case == "same" else 64
        srcs = [KVLayout(m, 32, "bf16", sa, tp, r) for r in range(tp)]
        dst = KVLayout(m, nd, dt, da, k_scale=0.5, v_scale=0.25) if case == "fp8_scales" else KVLayout(m, nd, dt, da)
        sep_src = []
        shared_src = []
        for lay in srcs:
            c = allocate(lay, 8)
            fill_random(lay, c, gen)
            sh = allocate_shared(lay, 8)
            for a, b in zip(tensors(sh), tensors(c)):
                a.copy_(b)
            sep_src.append((lay, c, [5, 1, 7, 2, 0, 3]))
            shared_src.append((lay, sh, [5, 1, 7, 2, 0, 3]))
        ref = allocate(dst, 8, fill=SENTINEL)
        got = allocate_shared(dst, 8)
        dblocks = [4, 0, 2, 6, 1][:-(-150 // nd)]
        with chunk_bytes(1 << 12):
            convert_from_ranks(sep_src, dst, ref, dblocks, 150, 13)
            fused_calls.clear()
            with rows_on_cpu():
                convert_from_ranks(shared_src, dst, got, dblocks, 150, 13)
        if not (case == "same" and sa == da):  # identical layouts move whole blocks raw (not the row path)
            assert len(fused_calls) >= 2 * tp, (sa, da)  # several chunks, every source rank fused
        for a, b in zip(tensors(ref), tensors(got)):
            assert torch.equal(bits(a), bits(b)), (sa, da, case)


def test_empty_heads_are_a_value_error():
    """``heads=[]`` asks for no KV head: ValueError naming it from ``convert``, ``pack`` and ``wire_chunks`` (was
    IndexError or ZeroDivisionError)."""
    m = ModelIdentity("L", 1, 2, 8)
    s, d = KVLayout(m, 4, "bf16", "vllm_flashinfer_nhd"), KVLayout(m, 4, "bf16", "lmdeploy")
    sc, dc = allocate(s, 4), allocate(d, 4)
    for call in (lambda: convert(s, sc, [0], d, dc, [1], 4, heads=[]),
                 lambda: pack(s, sc, [0], d, 0, 4, heads=[]),
                 lambda: wire_chunks(d, 0, 8, 1024, heads=[])):
        with pytest.raises(ValueError, match="at least one KV head"):
            call()


def test_a_destination_whose_blocks_are_not_one_dense_run_converts_exactly():
    """SGLang NHD K/V buffers ``[slots, H, D]`` carved out of wider rows (slot stride 19 elements, not H x D = 16):
    the arrangement accepts them and conversion into them is exact (was an IndexError from ``index_copy_``)."""
    m = ModelIdentity("L", 1, 2, 8)
    src, dst = KVLayout(m, 4, "bf16", "sglang_hnd"), KVLayout(m, 4, "bf16", "sglang_nhd")
    sc = allocate(src, 4)
    g = torch.Generator().manual_seed(0)
    n = 8
    vals = {t: (torch.randn(2, 8, generator=g).bfloat16(), torch.randn(2, 8, generator=g).bfloat16()) for t in range(n)}
    for t, (k, v) in vals.items():
        write_kv(src, sc, [1, 2], t, 0, k, v)
    bufs = [torch.zeros(16, 2 * 8 + 3, dtype=torch.bfloat16) for _ in range(2)]
    dc = [tuple(b[:, :16].view(16, 2, 8) for b in bufs)]
    assert dc[0][0].stride() == (19, 8, 1)
    convert(src, sc, [1, 2], dst, dc, [2, 0], n)
    for t in range(n):
        k, v = read_kv(dst, dc, [2, 0], t, 0)
        assert torch.equal(k, vals[t][0]) and torch.equal(v, vals[t][1])
    assert all(not b[:, 16:].any() for b in bufs)  # the padding is untouched


@pytest.mark.parametrize("scale", [1e-50, 1e39])
def test_fp8_scales_float32_cannot_hold_are_refused(scale):
    """fp8 re-scaling runs in float32: a scale outside its normal range (1e-50 flushed to 0 and converted to NaN,
    1e39 overflowed) is refused by the layout itself; the extremes inside it convert."""
    m = ModelIdentity("L", 1, 1, 4)
    with pytest.raises(ValueError, match="float32's normal range"):
        KVLayout(m, 4, "fp8_e4m3", "vllm_flashinfer_nhd", k_scale=scale, v_scale=scale)
    KVLayout(m, 4, "fp8_e4m3", "vllm_flashinfer_nhd", k_scale=1.2e-38, v_scale=3.4e38)


@pytest.mark.parametrize("sa,da", [("lmdeploy", "vllm_flash_hnd"), ("sglang_nhd", "sglang_hnd"),
                                   ("vllm_flash_nhd", "sglang_hnd")])
@pytest.mark.parametrize("s_one,d_one", [(True, False), (False, True)])
def test_separate_kv_caches_viewing_one_buffer_convert_exactly(sa, da, s_one, d_one):
    """K and V of a layer as views of one buffer (``allocate(one_buffer=True)``, an engine's pool): the CPU cell path
    took the V plane for a part of K, so it read K's bytes as V (silently wrong KV) or raised numpy's "output array
    does not match result of ndarray.take" (found running ``benchmarks/kv_convert_device.py --quick`` on the CPU)."""
    import random

    from dlmix.kv import read_kv

    model = ModelIdentity("LlamaForCausalLM", num_layers=2, num_kv_heads=8, head_size=128)
    src, dst = KVLayout(model, 32, "bf16", sa), KVLayout(model, 64, "bf16", da)
    n = 1024
    rng = random.Random(0)
    sb, db = list(range(n // 32)), list(range(n // 64))
    rng.shuffle(sb)
    rng.shuffle(db)
    sc, dc = allocate(src, len(sb), one_buffer=s_one), allocate(dst, len(db), one_buffer=d_one)
    g = torch.Generator().manual_seed(0)
    for c in sc:
        for t in c:
            t.copy_(torch.randn(t.shape, generator=g))
    convert(src, sc, sb, dst, dc, db, n)
    for tok in range(0, n, 5):
        for layer in range(2):
            for a, b in zip(read_kv(src, sc, sb, tok, layer), read_kv(dst, dc, db, tok, layer)):
                assert torch.equal(a, b), (tok, layer)
