"""The compiled conversion loops (:mod:`dlmix.kv.kernels`): taken at realistic sizes, bit-exact against the
per-token oracle, nothing written outside the requested tokens; the fp8 table loop equals ``cast_plane`` for every
source bit pattern."""
from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")

from dlmix.kv import KVLayout, ModelIdentity, allocate, cast_plane, convert, convert_from_ranks, read_kv  # noqa: E402
from dlmix.kv import kernels  # noqa: E402
from dlmix.kv.cast import _table  # noqa: E402

pytestmark = pytest.mark.skipif(not kernels.AVAILABLE, reason="numba is not installed")

MODEL = ModelIdentity("Llama", 2, 8, 128, "gqa")  # blocks of >= DIRECT_MIN_BYTES per plane


def _pool(layout: KVLayout, num_blocks: int, seed: int):
    caches = allocate(layout, num_blocks, fill=None)
    g = torch.Generator().manual_seed(seed)
    for c in caches:
        for t in (c if isinstance(c, tuple) else (c,)):
            t.view(torch.uint8).copy_(torch.randint(0, 60, t.view(torch.uint8).shape, generator=g,
                                                    dtype=torch.uint8))
    return caches


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.fixture(params=[True, False], ids=["compiled", "fallback"])
def compiled(request, monkeypatch) -> bool:
    """Run a case with the compiled loops and again without them (``AVAILABLE`` False: the torch/numpy paths)."""
    if not request.param:
        monkeypatch.setattr(kernels, "AVAILABLE", False)
    return request.param


def _spy(monkeypatch: pytest.MonkeyPatch, name: str) -> list:
    calls: list = []
    real = getattr(kernels, name)

    def spy(*a, **k):
        calls.append(name)
        return real(*a, **k)

    monkeypatch.setattr(kernels, name, spy)
    return calls


def _check(dst: KVLayout, dc, db, before, skip: int, n: int, truth) -> None:
    """Tokens skip..n equal the oracle; every other byte of the destination is unchanged."""
    for layer in range(dst.model.num_layers):
        for t in range(skip, n):
            got, want = read_kv(dst, dc, db, t, layer), truth(t, layer)
            for g, w in zip(got, want):
                assert torch.equal(_raw(g), _raw(w.to(g.dtype) if w.dtype != g.dtype else w)), (t, layer)
    # restore the written tokens from the snapshot and compare the whole caches: nothing else moved
    for layer in range(dst.model.num_layers):
        for t in range(skip, n):
            from dlmix.kv import write_kv

            k0, v0 = read_kv(dst, before, db, t, layer)
            write_kv(dst, dc, db, t, layer, k0, v0)
    for a, b in zip(dc, before):
        for x, y in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
            assert torch.equal(_raw(x), _raw(y))


def _clone(caches):
    return [tuple(x.clone() for x in c) if isinstance(c, tuple) else c.clone() for c in caches]


@pytest.mark.parametrize("src_arr,dtype,kernel", [
    ("vllm_flash_nhd", "bf16", "transpose_blocks"),   # vLLM CPU K^T pages, 16-bit words
    ("vllm_flash_hnd", "fp32", "transpose_blocks"),   # 32-bit words
    ("lmdeploy", "fp16", "transpose_blocks"),
    ("vllm_flash_nhd", "fp8_e4m3", "copy_blocks"),    # 1-byte elements: the element loop
])
def test_equal_block_rearrangement_into_vllm_cpu(monkeypatch, compiled, src_arr, dtype, kernel) -> None:
    calls = _spy(monkeypatch, kernel)
    fp8 = dtype.startswith("fp8")
    src = KVLayout(MODEL, 32, dtype, src_arr, k_scale=0.5 if fp8 else 1.0)
    dst = KVLayout(MODEL, 32, dtype, "vllm_cpu", k_scale=0.5 if fp8 else 1.0)
    n, skip = 5 * 32 + 7, 3  # partial first and last blocks go per segment
    rng = random.Random(2)
    sb, db = rng.sample(range(9), 6), rng.sample(range(9), 6)
    sc, dc = _pool(src, 9, 1), _pool(dst, 9, 2)
    before = _clone(dc)
    convert(src, sc, sb, dst, dc, db, n, skip)
    assert bool(calls) == compiled
    _check(dst, dc, db, before, skip, n, lambda t, layer: read_kv(src, sc, sb, t, layer))


@pytest.mark.parametrize("arr,dtype", [("vllm_flash_nhd", "bf16"), ("vllm_cpu", "bf16"), ("vllm_flash_hnd", "fp32")])
def test_tp_reshard_in_one_sweep(monkeypatch, compiled, arr, dtype) -> None:
    calls = _spy(monkeypatch, "copy_blocks")
    srcs = []
    for r in range(2):
        lay = KVLayout(MODEL, 32, dtype, arr, tp_size=2, tp_rank=r)
        srcs.append((lay, _pool(lay, 9, 10 + r), random.Random(r).sample(range(9), 6)))
    dst = KVLayout(MODEL, 32, dtype, arr)
    db = random.Random(5).sample(range(9), 6)
    dc = _pool(dst, 9, 3)
    before = _clone(dc)
    n, skip = 5 * 32 + 7, 3
    convert_from_ranks(srcs, dst, dc, db, n, skip)
    assert bool(calls) == compiled

    def truth(t, layer):
        parts = [read_kv(lay, c, b, t, layer) for lay, c, b in srcs]
        return tuple(torch.cat([p[i] for p in parts], dim=-2) for i in range(2))

    _check(dst, dc, db, before, skip, n, truth)


@pytest.mark.parametrize("src_dtype,dst_dtype,scales", [
    ("bf16", "fp8_e4m3", (1.0, 0.5)), ("bf16", "fp8_e4m3", (1.0, 0.37)), ("fp16", "fp8_e5m2", (1.0, 0.25)),
    ("fp8_e4m3", "bf16", (0.5, 1.0)), ("fp8_e4m3", "fp8_e4m3", (0.5, 2.0)), ("fp8_e5m2", "fp32", (4.0, 1.0)),
])
def test_lookup_loop_equals_cast_plane_for_every_bit_pattern(src_dtype, dst_dtype, scales) -> None:
    m = ModelIdentity("t", 1, 1, 1)
    sl = KVLayout(m, 1, src_dtype, "lmdeploy", k_scale=scales[0] if "fp8" in src_dtype else 1.0)
    dl = KVLayout(m, 1, dst_dtype, "lmdeploy", k_scale=scales[1] if "fp8" in dst_dtype else 1.0)
    table = _table(sl.dtype, sl.k_scale, dl.dtype, dl.k_scale)
    nbits = 8 * sl.itemsize
    codes = np.arange(1 << nbits, dtype=np.int64).astype(np.uint8 if nbits == 8 else np.uint16).reshape(-1, 1, 1)
    out = np.zeros(codes.shape, dtype=table.dtype)
    # two runs: the second half first, written to the front (the loop honours run offsets)
    half = codes.shape[0] // 2
    kernels.lookup_runs(table, codes, out, np.array([[half, 0, half], [0, half, half]], dtype=np.int64))
    tdt = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
    src = torch.from_numpy(codes.reshape(-1).view(np.int8 if nbits == 8 else np.int16).copy())
    want = cast_plane(src.view(tdt[sl.itemsize]) if nbits == 16 else src.view(torch.uint8), sl, dl, 0)
    want_bits = want.contiguous().view(tdt[dl.itemsize]).numpy().view(table.dtype).reshape(-1)
    got = np.concatenate([out.reshape(-1)[half:], out.reshape(-1)[:half]])
    assert np.array_equal(got, want_bits)


def test_fp8_conversion_takes_the_lookup_loop(monkeypatch, compiled) -> None:
    calls = _spy(monkeypatch, "lookup_runs")
    src = KVLayout(MODEL, 64, "bf16", "vllm_flash_nhd")  # block sizes differ too
    dst = KVLayout(MODEL, 32, "fp8_e4m3", "vllm_flash_nhd", k_scale=0.5, v_scale=0.25)
    n, skip = 4 * 64 + 5, 9
    sb, db = random.Random(1).sample(range(8), 5), random.Random(2).sample(range(16), 9)
    sc, dc = _pool(src, 8, 1), _pool(dst, 16, 2)
    before = _clone(dc)
    convert(src, sc, sb, dst, dc, db, n, skip)
    assert bool(calls) == compiled

    def truth(t, layer):
        k, v = read_kv(src, sc, sb, t, layer)
        return cast_plane(k, src, dst, 0), cast_plane(v, src, dst, 1)

    _check(dst, dc, db, before, skip, n, truth)
