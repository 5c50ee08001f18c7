"""DLMixConnector's description of vLLM's per-layer KV caches, checked against the installed vLLM's own code.

For every ``KVCacheLayout`` of vLLM 0.32 (``vllm/v1/kv_cache_layout.py``) the per-layer tensors are built exactly as
vLLM's workers build them (``compute_layout_strides`` and ``create_kv_cache_views`` of
``vllm/v1/kv_cache_interface.py`` over one raw buffer). The layer-compact layouts must be described
(``dlmix_vllm.layout.physical_layers`` + ``arrangement_for``) so that every element vLLM's FlashAttention/Triton
backends read as K (``C[:D]``) or V (``C[D:]``) of (block, head, token) is what dlmix's plane views name; the
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


@pytest.mark.parametrize("name, order, arrangement", [("LBHNC", "BHNC", "vllm_lbhnc"),
                                                       ("LBNHC", "BNHC", "vllm_lbnhc")])
@pytest.mark.parametrize("backend", ["FLASH_ATTN", "TRITON_ATTN"])
def test_layer_compact_layouts_are_described_element_for_element(name, order, arrangement, backend):
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
    with pytest.raises(ValueError, match="'FLASHINFER'"):
        arrangement_for("FLASHINFER", "BHNC")
    with pytest.raises(ValueError, match="'ROCM_ATTN'"):
        arrangement_for("ROCM_ATTN", "BHNC")
