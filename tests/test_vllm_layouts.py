"""DLMixConnector's description of vLLM's per-layer KV caches, checked against the installed vLLM's own code.

For every ``KVCacheLayout`` of vLLM 0.32 (``vllm/v1/kv_cache_layout.py``) the per-layer tensors are built exactly as
vLLM's workers build them (``compute_layout_strides`` and ``create_kv_cache_views`` of
``vllm/v1/kv_cache_interface.py`` over one raw buffer). The layer-compact layouts each described backend class
accepts (its own ``supported_kv_cache_layouts``) must be described (``dlmix_vllm.layout.physical_layers`` +
``arrangement_for``) so that every element the backend reads as K (``C[:D]``) or V (``C[D:]``) of (block, head,
token) is what dlmix's plane views name; the
layer- and head-interleaved layouts and unknown backends must be refused with the reason.
"""
from __future__ import annotations

import pytest
import torch

vllm = pytest.importorskip("vllm")

from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheTensor,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from dlmix.kv import KVLayout, ModelIdentity  # noqa: E402
from dlmix.kv.ops import plane_views  # noqa: E402
from dlmix_vllm.layout import arrangement_for, physical_layers  # noqa: E402

B, H, N, D, L = 5, 4, 16, 8, 3


def _vllm_layers(layout: KVCacheLayout) -> list[torch.Tensor]:
    """L per-layer caches as a vLLM 0.32 worker views them (logical ``[B, H, N, 2*D]`` fp32), filled with ids."""
    spec = FullAttentionSpec(block_size=N, num_kv_heads=H, head_size=D, dtype=torch.float32)
    layer_stride, block_stride, *_ = compute_layout_strides(spec, B, L, layout)
    size = L * B * spec.page_size_bytes
    raw = torch.zeros(size, dtype=torch.int8)
    kvt = KVCacheTensor(size=size, layers=[f"model.layers.{i}.self_attn.attn" for i in range(L)],
                        layer_stride=layer_stride, block_stride=block_stride)
    views = create_kv_cache_views(raw, spec, B, layout, kvt)
    for i, v in enumerate(views):  # a distinct value per logical element
        v.copy_(torch.arange(v.numel(), dtype=torch.float32).reshape(v.shape) + i * 1e6)
    return views


#: backends whose caches dlmix describes: (module under vllm/v1/attention/backends, class); each splits the
#: logical [B, H, N, 2D] view into K = C[:D] and V = C[D:] (see dlmix_vllm.layout._BACKEND_ARRANGEMENTS)
BACKENDS = {"FLASH_ATTN": ("flash_attn", "FlashAttentionBackend"),
            "TRITON_ATTN": ("triton_attn", "TritonAttentionBackend"),
            "FLASHINFER": ("flashinfer", "FlashInferBackend"),
            "FLEX_ATTENTION": ("flex_attention", "FlexAttentionBackend"),
            "ROCM_AITER_UNIFIED_ATTN": ("rocm_aiter_unified_attn", "RocmAiterUnifiedAttentionBackend")}
COMPACT = {"LBHNC": ("BHNC", "vllm_lbhnc"), "LBNHC": ("BNHC", "vllm_lbnhc")}


def _supported(backend: str) -> tuple[str, ...]:
    """The layer-compact KVCacheLayouts the installed vLLM's backend class accepts (its
    ``supported_kv_cache_layouts``; None = any). FlashInfer's class needs the flashinfer package (a GPU build): its
    source does not restrict the layouts below compute capability 10 and allows LBHNC at 10."""
    import importlib

    mod, cls = BACKENDS[backend]
    try:
        klass = getattr(importlib.import_module(f"vllm.v1.attention.backends.{mod}"), cls)
    except ImportError:
        assert backend == "FLASHINFER"
        return tuple(COMPACT)
    assert klass.get_name() == backend
    layouts = klass.supported_kv_cache_layouts()
    return tuple(n for n in COMPACT if layouts is None or KVCacheLayout[n] in layouts)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_every_layout_a_described_backend_accepts_is_described(backend):
    """For each layer-compact layout the backend class accepts, dlmix names an arrangement; for one it refuses,
    dlmix refuses too (never a guess)."""
    ok = _supported(backend)
    assert ok, backend
    for name, (order, arrangement) in COMPACT.items():
        if name in ok:
            assert arrangement_for(backend, order) == arrangement
        else:
            with pytest.raises(ValueError, match=repr(backend)):
                arrangement_for(backend, order)


@pytest.mark.parametrize("name, order, arrangement", [("LBHNC", "BHNC", "vllm_lbhnc"),
                                                       ("LBNHC", "BNHC", "vllm_lbnhc")])
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_layer_compact_layouts_are_described_element_for_element(name, order, arrangement, backend):
    if name not in _supported(backend):
        pytest.skip(f"{backend} does not accept {name} (vLLM's supported_kv_cache_layouts)")
    views = _vllm_layers(KVCacheLayout[name])
    got_order, phys = physical_layers(views)
    assert got_order == order and all(t.is_contiguous() for t in phys)
    arr = arrangement_for(backend, got_order)
    assert arr == arrangement
    lay = KVLayout(ModelIdentity("LlamaForCausalLM", L, H, D, "gqa"), N, "fp32", arr)
    for logical, t in zip(views, phys):
        assert t.data_ptr() == logical.data_ptr()  # the same memory, viewed in its physical order
        k, v = plane_views(lay, t)  # dlmix: [B, N, H, D] per plane
        # vLLM's backends: key_cache, value_cache = kv_cache.transpose(1, 2).split(D, dim=-1) on [B, H, N, 2D]
        vk, vv = logical.transpose(1, 2).split(D, dim=-1)
        assert torch.equal(k, vk) and torch.equal(v, vv)


def test_cpu_backend_is_vllm_cpu_and_only_in_its_layout():
    views = _vllm_layers(KVCacheLayout.LBHNC)
    order, _ = physical_layers(views)
    assert arrangement_for("CPU_ATTN", order) == "vllm_cpu"
    with pytest.raises(ValueError, match="CPU_ATTN.*BNHC"):
        arrangement_for("CPU_ATTN", "BNHC")


@pytest.mark.parametrize("name", ["LHBNC", "BLHNC", "BLNHC", "BHLNC"])
def test_interleaved_layouts_are_refused(name):
    views = _vllm_layers(KVCacheLayout[name])
    with pytest.raises(ValueError, match="not a dense block-major tensor"):
        physical_layers(views)


def test_unknown_backend_is_refused_by_name():
    with pytest.raises(ValueError, match="'ROCM_ATTN'"):
        arrangement_for("ROCM_ATTN", "BHNC")  # K through PagedAttention.split_kv_cache: x-element groups
    with pytest.raises(ValueError, match="'FLASHMLA'"):
        arrangement_for("FLASHMLA", "BHNC")
    with pytest.raises(ValueError, match="'ROCM_ATTN'"):
        arrangement_for("ROCM_ATTN", "BHNC")


def _mla_layers(layout: KVCacheLayout, dtype=torch.float32) -> list[torch.Tensor]:
    """L per-layer MLA caches as a vLLM 0.32 worker views them (``MLAAttentionSpec``: one KV head, logical
    ``[B, 1, N, 576]``), built by vLLM's own ``create_kv_cache_views``."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    spec = MLAAttentionSpec(block_size=N, num_kv_heads=1, head_size=576, dtype=dtype)
    layer_stride, block_stride, *_ = compute_layout_strides(spec, B, L, layout)
    size = L * B * spec.page_size_bytes
    kvt = KVCacheTensor(size=size, layers=[f"model.layers.{i}.self_attn.attn" for i in range(L)],
                        layer_stride=layer_stride, block_stride=block_stride)
    return create_kv_cache_views(torch.zeros(size, dtype=torch.int8), spec, B, layout, kvt)


def test_cpu_mla_caches_are_the_mla_latent_rows_its_kernels_index():
    """vLLM CPU's MLA backends index each layer's cache as token rows, ``kv_cache.view(-1, 576)[slot]`` =
    ``[latent (512) | rope K (64)]`` (``cpu_mla.py`` ``do_kv_cache_update``; ``amx_mla.py`` writes through
    ``amx_mla_concat_and_cache`` and reads ``view(-1, 1, head_size)``). dlmix's ``mla`` arrangement over
    :func:`latent_layers` names the same element for every (block, token), and the AMX write op (where this host
    runs it) fills exactly those rows."""
    from dlmix_vllm.layout import latent_layers

    views = _mla_layers(KVCacheLayout.LBHNC)
    order, phys = physical_layers(views)
    for backend in ("CPU_MLA", "AMX_MLA"):
        assert arrangement_for(backend, order) == "mla"
    lat = latent_layers(phys)
    lay = KVLayout(ModelIdentity("DeepseekV2ForCausalLM", L, 1, 576, "mla", kv_lora_rank=512, rope_dim=64),
                   N, "fp32", "mla")
    for i, (logical, t) in enumerate(zip(views, lat)):
        assert t.shape == (B, N, 576) and t.data_ptr() == logical.data_ptr()
        flat = logical.view(-1, 576)  # the backends' token-row view
        flat.copy_(torch.arange(flat.numel(), dtype=torch.float32).reshape(flat.shape) + i * 1e7)
        (plane,) = plane_views(lay, t)  # [B, N, 1, 576]
        for b, n in ((0, 0), (2, 5), (B - 1, N - 1)):
            assert torch.equal(plane[b, n, 0], flat[b * N + n])
    with pytest.raises(ValueError, match="one latent plane"):
        latent_layers(_vllm_layers(KVCacheLayout.LBHNC))  # 4 KV heads: not an MLA cache

    from vllm import _custom_ops as ops

    if not (hasattr(ops, "amx_mla_concat_and_cache") and torch.cpu._is_amx_tile_supported()):
        return
    cache = latent_layers(physical_layers(_mla_layers(KVCacheLayout.LBHNC, torch.bfloat16))[1])[0]
    slots = torch.tensor([0, 17, 33, 40, B * N - 1])
    kv_c, k_pe = torch.randn(5, 512).bfloat16(), torch.randn(5, 64).bfloat16()
    ops.amx_mla_concat_and_cache(kv_c, k_pe, cache, slots)
    rows = cache.reshape(-1, 576)
    assert torch.equal(rows[slots], torch.cat([kv_c, k_pe], -1))
    assert rows.abs().sum(-1).nonzero().flatten().tolist() == slots.tolist()
