"""The ``vllm_cpu`` arrangement against vLLM's own CPU cache-write kernel (no server).

vLLM's CPU attention (``vllm/v1/attention/backends/cpu_attn.py``) stores K/V with
``ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, isa, k_scale, v_scale,
kv_cache_dtype)`` where ``key_cache, value_cache = kv_cache.view(B, H, 2N, D).chunk(2, dim=2)``. Here that kernel fills
a cache and dlmix's descriptor must read back exactly the K/V it was given; dlmix's conversion into ``vllm_cpu``
must produce the same bytes as the kernel.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from dlmix.kv import KVLayout, ModelIdentity, allocate, convert, read_kv, write_kv  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.no_engine_servers]  # vLLM's kernel in this process


def _vllm_write(kv: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype,
                k_scale: float = 1.0, v_scale: float = 1.0, kv_cache_dtype: str = "auto") -> None:
    from vllm._custom_ops import cpu_attn_reshape_and_cache
    from vllm.v1.attention.backends import cpu_attn

    from dlmix_vllm.layout import pin_cpu_attn_isa

    pin_cpu_attn_isa()  # as DLMixConnector does: "vec", never "amx" (test_amx_isa_is_pinned_to_vec)
    _get_attn_isa = cpu_attn._get_attn_isa
    B, H, N, C = kv.shape
    D = C // 2
    key_cache, value_cache = kv.view(B, H, 2 * N, D).chunk(2, dim=2)  # as CPUAttentionBackendImpl.forward
    isa = _get_attn_isa(dtype, N, D, kv_cache_dtype if kv_cache_dtype != "auto" else None)
    cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa, k_scale=k_scale, v_scale=v_scale,
                               kv_cache_dtype=kv_cache_dtype)


def _slots(block_ids: list[int], n: int, bs: int) -> torch.Tensor:
    t = torch.arange(n)
    return torch.tensor(block_ids)[t // bs] * bs + t % bs


@pytest.mark.parametrize("dtype,name", [(torch.float32, "fp32"), (torch.bfloat16, "bf16"), (torch.float16, "fp16")])
@pytest.mark.parametrize("bs", [32, 128])
def test_vllm_cpu_kernel_layout(dtype: torch.dtype, name: str, bs: int) -> None:
    m = ModelIdentity("LlamaForCausalLM", 1, 3, 64)  # SmolLM2 heads: 3 KV heads, head_dim 64
    lay = KVLayout(m, bs, name, "vllm_cpu")
    n = bs + 37
    bids = [3, 1, 4]
    gen = torch.Generator().manual_seed(0)
    key = torch.randn(n, 3, 64, generator=gen).to(dtype)
    value = torch.randn(n, 3, 64, generator=gen).to(dtype)
    vllm_cache = allocate(lay, 5)
    _vllm_write(vllm_cache[0], key, value, _slots(bids, n, bs), dtype)
    for t in range(n):
        k, v = read_kv(lay, vllm_cache, bids, t, 0)
        assert torch.equal(k, key[t]) and torch.equal(v, value[t]), t
    # dlmix writing the same K/V (from an LMDeploy-arranged cache, other block size) gives the kernel's bytes
    src = KVLayout(m, 16, name, "lmdeploy")
    sc = allocate(src, 20)
    sb = list(range(19, 19 - (n + 15) // 16, -1))
    for t in range(n):
        write_kv(src, sc, sb, t, 0, key[t], value[t])
    mine = allocate(lay, 5)
    convert(src, sc, sb, lay, mine, bids, n)
    assert torch.equal(mine[0].view(torch.uint8), vllm_cache[0].view(torch.uint8))


def test_vllm_cpu_kernel_fp8_scales() -> None:
    """fp8 (e4m3) with per-tensor k_scale/v_scale: vLLM stores fp8(x / scale), K transposed like the bf16 case.

    Measured: vLLM's CPU kernel rounds x / scale toward zero, dlmix rounds to nearest; both decode within one fp8
    step, so mixed fleets agree within fp8 precision but not bit for bit.
    """
    if not torch.cpu._is_avx512_supported():
        pytest.skip("vLLM's CPU fp8 KV cache needs AVX-512")
    m = ModelIdentity("LlamaForCausalLM", 1, 2, 64)
    bs, n, bids = 32, 50, [2, 0]
    lay = KVLayout(m, bs, "fp8_e4m3", "vllm_cpu", k_scale=0.5, v_scale=2.0)
    gen = torch.Generator().manual_seed(1)
    key = torch.randn(n, 2, 64, generator=gen).to(torch.bfloat16)
    value = torch.randn(n, 2, 64, generator=gen).to(torch.bfloat16)
    cache = allocate(lay, 3, storage_uint8=True)
    _vllm_write(cache[0], key, value, _slots(bids, n, bs), torch.bfloat16, 0.5, 2.0, "fp8")
    src = KVLayout(m, bs, "bf16", "vllm_flash_nhd")
    sc = allocate(src, 2)
    for t in range(n):
        write_kv(src, sc, [0, 1], t, 0, key[t], value[t])
    mine = allocate(lay, 3, storage_uint8=True)
    convert(src, sc, [0, 1], lay, mine, bids, n)
    nearest = 0
    for t in range(n):
        k, v = read_kv(lay, cache, bids, t, 0, dequantize=True)
        # vLLM's CPU kernel rounds toward zero: |stored| <= |x| and within one e4m3 step (2^-3 relative)
        for got, ref in ((k, key[t].float()), (v, value[t].float())):
            assert torch.all(got.abs() <= ref.abs()) and torch.all(got * ref >= 0)
            assert torch.allclose(got, ref, rtol=2**-3, atol=2**-7)
        km, vm = read_kv(lay, mine, bids, t, 0, dequantize=True)
        # dlmix rounds to nearest (as CUDA vLLM's fp8 conversion): never farther from x than vLLM CPU's value
        assert torch.all((km - key[t].float()).abs() <= (k - key[t].float()).abs() + 1e-7)
        assert torch.all((vm - value[t].float()).abs() <= (v - value[t].float()).abs() + 1e-7)
        nearest += int(torch.equal(km, k)) + int(torch.equal(vm, v))
    assert nearest < 2 * n  # the two roundings do differ on random data


def test_amx_isa_is_pinned_to_vec(monkeypatch) -> None:
    """On an AMX host vLLM would store bf16 KV in its AMX tile layout, which ``vllm_cpu`` does not describe:
    DLMixConnector pins the ISA choice to "vec" (any host: the AMX answer is simulated here)."""
    from vllm.v1.attention.backends import cpu_attn

    from dlmix_vllm.layout import pin_cpu_attn_isa

    monkeypatch.setattr(cpu_attn, "_get_attn_isa", lambda *a, **k: "amx" if a[0] == torch.bfloat16 else "vec")
    assert pin_cpu_attn_isa() is True and pin_cpu_attn_isa() is True  # idempotent
    assert cpu_attn._get_attn_isa(torch.bfloat16, 32, 64) == "vec"
    assert cpu_attn._get_attn_isa(torch.float32, 32, 64) == "vec"
    assert cpu_attn._get_attn_isa.__wrapped__(torch.bfloat16, 32, 64) == "amx"
