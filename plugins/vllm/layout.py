"""Describe this vLLM engine's real KV cache as a :class:`dlmix.kv.KVLayout` (the vLLM-specific half of the pair
check; the check itself is :func:`dlmix.pd.pair.check_pair`, re-exported here).

vLLM CPU (0.32, attention backend ``CPU_ATTN``, layout ``LBHNC``) gives the connector one tensor per attention layer,
shape ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``; inside every ``(block, head)`` page the first
``block_size * head_size`` elements are K transposed (``[head_size][block_size]``, post-RoPE), the rest V row-major.
dlmix calls this arrangement ``vllm_cpu`` (see :mod:`dlmix.kv.layout`); ``tests/test_vllm_pd.py`` checks it against
transformers' post-RoPE ``past_key_values`` through a debug dump of the real cache.

The descriptor exchanged between instances is ``KVLayout.to_dict()`` (JSON). The model identity includes a weights
fingerprint (:func:`dlmix.pd.fingerprint.weights_fingerprint`, the core's, re-exported here) so a prefill with different weights is refused by default.
"""
from __future__ import annotations

import re
from typing import Any

import torch

from dlmix.kv import KVLayout, ModelIdentity
from dlmix.pd.fingerprint import weights_fingerprint
from dlmix.pd.pair import check_pair, layout_of

__all__ = [
    "ARRANGEMENT",
    "arrangement_for",
    "attention_info",
    "physical_layers",
    "pin_cpu_attn_isa",
    "describe_engine",
    "latent_layers",
    "weights_fingerprint",
    "check_pair",
    "layout_of",
    "ordered_layers",
]

ARRANGEMENT = "vllm_cpu"
_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


#: vLLM 0.32 per-layer caches: a logical ``[B, H, N, C]`` view per layer (``vllm/v1/kv_cache_interface.py``
#: ``create_kv_cache_views``) whose physical axis order is the resolved ``KVCacheLayout`` (``vllm/v1/kv_cache_layout.py``:
#: ``LBHNC`` = ``[B, H, N, C]``, ``LBNHC`` = ``[B, N, H, C]`` per layer; the layouts with ``B`` or ``H`` outside ``L``
#: interleave layers or heads over blocks and give no block-major per-layer tensor). What ``C`` holds is the
#: attention backend's: FlashAttention, Triton, FlashInfer (non-NVFP4 caches), FlexAttention and ROCm AITER unified
#: attention split it into K ``[:D]`` and V ``[D:]`` (``flash_attn.py``, ``triton_attn.py``, ``flashinfer.py``,
#: ``flex_attention.py``, ``rocm_aiter_unified_attn.py`` under ``vllm/v1/attention/backends/``:
#: ``kv_cache.transpose(1, 2).split(head_size, dim=-1)``); vLLM CPU stores each (block, head) page as K transposed
#: then V (``cpu_attn.py``; arrangement ``vllm_cpu``). Not described, so refused: ``ROCM_ATTN`` (its HIP kernels
#: read K through ``PagedAttention.split_kv_cache``, head size split in groups of ``x`` elements), FlashInfer's
#: NVFP4 cache (K and V as separate head groups, with block scales) and the GPU MLA backends. vLLM CPU's MLA backends
#: hold one latent plane per layer, logical ``[B, 1, N, kv_lora_rank + rope_dim]`` (one KV head), token rows of
#: ``[latent | rope K]`` (``cpu_mla.py`` and ``amx_mla.py`` ``do_kv_cache_update``/``forward_mqa``:
#: ``kv_cache.view(-1, kv_lora_rank + pe_dim)``, ``view(-1, 1, head_size)``): arrangement ``mla``.
#: FlexAttention supports ``LBNHC`` only (``FlexAttentionBackend.supported_kv_cache_layouts``).
_BACKEND_ARRANGEMENTS = {
    ("CPU_ATTN", "BHNC"): "vllm_cpu",
    ("FLASH_ATTN", "BHNC"): "vllm_lbhnc",
    ("FLASH_ATTN", "BNHC"): "vllm_lbnhc",
    ("TRITON_ATTN", "BHNC"): "vllm_lbhnc",
    ("TRITON_ATTN", "BNHC"): "vllm_lbnhc",
    ("FLASHINFER", "BHNC"): "vllm_lbhnc",
    ("FLASHINFER", "BNHC"): "vllm_lbnhc",
    ("FLEX_ATTENTION", "BNHC"): "vllm_lbnhc",
    ("ROCM_AITER_UNIFIED_ATTN", "BHNC"): "vllm_lbhnc",
    ("CPU_MLA", "BHNC"): "mla",
    ("AMX_MLA", "BHNC"): "mla",
}


def arrangement_for(backend: str, physical_order: str) -> str:
    """The dlmix arrangement of vLLM per-layer caches written by attention backend ``backend`` (its ``get_name()``,
    e.g. ``CPU_ATTN``, ``FLASH_ATTN``) with the per-layer physical axis order ``physical_order`` (``"BHNC"`` or
    ``"BNHC"``, from :func:`physical_layers`). Raises ValueError naming the backend and order when dlmix does not
    describe that combination (an unknown backend is refused, never assumed)."""
    arr = _BACKEND_ARRANGEMENTS.get((str(backend).upper(), physical_order))
    if arr is None:
        known = sorted({b for b, _ in _BACKEND_ARRANGEMENTS})
        raise ValueError(f"DLMixConnector does not describe the KV cache of attention backend {backend!r} with "
                         f"per-layer axis order {physical_order} (described: "
                         f"{', '.join(f'{b} {o}' for b, o in sorted(_BACKEND_ARRANGEMENTS))}; backends {known})")
    return arr


def physical_layers(layers: list[torch.Tensor]) -> tuple[str, list[torch.Tensor]]:
    """The per-layer caches vLLM registered (logical ``[B, H, N, C]`` views) as dense tensors in their physical axis
    order, and that order: ``("BHNC", layers)`` or ``("BNHC", [t.transpose(1, 2) ...])``. Reads the strides, assumes
    nothing. Raises ValueError when a layer is not 4-D or not one dense block-major tensor in either order (vLLM's
    layer- or head-interleaved ``KVCacheLayout`` s)."""
    orders = {"BHNC": (0, 1, 2, 3), "BNHC": (0, 2, 1, 3)}
    found: str | None = None
    out = []
    for i, t in enumerate(layers):
        if t.dim() != 4:
            raise ValueError(f"KV cache layer {i} has shape {tuple(t.shape)}; expected vLLM's [B, H, N, C] view")
        name = next((n for n, o in orders.items() if t.permute(*o).is_contiguous()), None)
        if name is None:
            raise ValueError(f"KV cache layer {i} (shape {tuple(t.shape)}, strides {tuple(t.stride())}) is not a dense "
                             "block-major tensor in [B, H, N, C] or [B, N, H, C] order (a layer- or head-interleaved "
                             "vLLM KV cache layout, which DLMixConnector does not describe)")
        if found is not None and name != found:
            raise ValueError(f"KV cache layer {i} is {name}, layer 0 {found}")
        found = name
        out.append(t.permute(*orders[name]))
    return found or "BHNC", out


def latent_layers(layers: list[torch.Tensor]) -> list[torch.Tensor]:
    """MLA caches as :func:`physical_layers` gives them (``[B, 1, N, D]``: one KV head) as the ``[B, N, D]`` latent
    tensors of arrangement ``mla`` (views, no copy). Raises ValueError when a layer has more than one head."""
    out = []
    for i, t in enumerate(layers):
        if t.dim() != 4 or t.shape[1] != 1:
            raise ValueError(f"MLA KV cache layer {i} has shape {tuple(t.shape)}; expected [B, 1, N, D] (one latent "
                             "plane)")
        out.append(t[:, 0])
    return out


def attention_info(vllm_config: Any, layer_names: list[str]) -> tuple[str, tuple[float, float]]:
    """What the model's attention layers for the KV cache layers ``layer_names`` say about the cache (read once,
    ``vllm.config.get_layers_from_vllm_config``): the ``get_name()`` of the attention backend vLLM selected, and
    the per-tensor fp8 KV scales ``(k_scale, v_scale)`` (``layer._k_scale_float``/``_v_scale_float``: 1.0 unless
    the checkpoint calibrated them; the cache holds ``fp8(x / scale)``). With no model layer registered (caches
    registered outside a model, in tests): ``CPU_ATTN``, vLLM CPU's only backend, and ``(1.0, 1.0)``.
    Raises ValueError when the layers use several backends (or none, off CPU) or different scales (one scale pair
    per cache is what :class:`dlmix.kv.KVLayout` describes)."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase, layer_names).values()
    names = {layer.get_attn_backend().get_name() for layer in layers}
    if not names:
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            names = {"CPU_ATTN"}
    if len(names) != 1:
        raise ValueError(f"KV cache layers use attention backends {sorted(names)}; DLMixConnector needs exactly one")
    pairs = {(float(getattr(layer, "_k_scale_float", 1.0)), float(getattr(layer, "_v_scale_float", 1.0)))
             for layer in layers}
    if len(pairs) > 1:
        raise ValueError(f"KV cache layers have different fp8 scales {sorted(pairs)[:4]}; DLMixConnector describes "
                         "one (k_scale, v_scale) per cache")
    return names.pop(), (pairs.pop() if pairs else (1.0, 1.0))


_FP8_NAMES = {"fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}


def describe_engine(vllm_config: Any, kv_cache_config: Any = None, *, tp_rank: int = 0,
                    arrangement: str | None = None, scales: tuple[float, float] = (1.0, 1.0)) -> KVLayout:
    """This engine's KV layout from its config (no tensors needed, so the scheduler side can build it too):
    block size (tokens, from the KV cache spec when given), cache dtype, ``arrangement`` (the workers' from
    :func:`arrangement_for`; until they report it ``vllm_cpu``, or ``mla`` for an MLA model), TP rank/size and the
    model identity (architecture, layers, total KV heads, head size, weights fingerprint).

    MLA models (vLLM's ``model_config.use_mla``: DeepSeek-V2/V3 style, ``kv_lora_rank`` in the config) are described
    as one latent plane: ``attention="mla"``, one KV head, head size ``kv_lora_rank + qk_rope_head_dim`` elements.

    ``scales``: the fp8 ``(k_scale, v_scale)`` (:func:`attention_info`; ignored for other dtypes). Raises ValueError for
    KV cache dtypes the connector does not handle (``--kv-cache-dtype`` other than auto, fp32/bf16/fp16 and
    ``fp8``/``fp8_e4m3``/``fp8_e5m2``; no fp8 for an MLA cache, whose fp8 formats carry their own scales).
    """
    import vllm

    mc = vllm_config.model_config
    pc = vllm_config.parallel_config
    cc = vllm_config.cache_config
    block_size = cc.block_size
    if kv_cache_config is not None and getattr(kv_cache_config, "kv_cache_groups", None):
        block_size = getattr(kv_cache_config.kv_cache_groups[0].kv_cache_spec, "block_size", block_size)
    if cc.cache_dtype in (None, "auto"):
        if mc.dtype not in _DTYPE_NAMES:
            raise ValueError(f"KV cache dtype {mc.dtype} is not supported by DLMixConnector")
        dtype = _DTYPE_NAMES[mc.dtype]
    elif cc.cache_dtype in ("float32", "bfloat16", "float16", "fp32", "bf16", "fp16"):
        dtype = str(cc.cache_dtype)
    elif cc.cache_dtype in _FP8_NAMES:
        dtype = _FP8_NAMES[cc.cache_dtype]
    else:
        raise ValueError(f"KV cache dtype {cc.cache_dtype!r} is not supported by DLMixConnector (use auto or fp8)")
    archs = list(getattr(mc.hf_config, "architectures", None) or [])
    common = dict(architecture=archs[0] if archs else "unknown", num_layers=int(mc.get_num_layers(pc)),
                  weights_fingerprint=weights_fingerprint(str(mc.model)))
    if getattr(mc, "use_mla", False):
        if dtype.startswith("fp8"):
            raise ValueError(f"KV cache dtype {cc.cache_dtype!r} with an MLA model is not supported by DLMixConnector "
                             "(use auto)")
        hf = mc.hf_text_config
        lora, rope = getattr(hf, "kv_lora_rank", None), getattr(hf, "qk_rope_head_dim", None)
        if lora is None or rope is None:
            raise ValueError(f"MLA model {archs[:1]} without kv_lora_rank/qk_rope_head_dim in its config is not "
                             "described by DLMixConnector")
        lora, rope = int(lora), int(rope)
        ident = ModelIdentity(num_kv_heads=1, head_size=lora + rope, attention="mla", kv_lora_rank=lora,
                              rope_dim=rope, **common)
        arrangement = arrangement or "mla"
    else:
        total_heads = int(mc.get_total_num_kv_heads())
        ident = ModelIdentity(
            num_kv_heads=total_heads, head_size=int(mc.get_head_size()),
            attention="mha" if total_heads == int(getattr(mc.hf_text_config, "num_attention_heads", -1)) else "gqa",
            **common)
        arrangement = arrangement or ARRANGEMENT
    k_scale, v_scale = scales if dtype.startswith("fp8") else (1.0, 1.0)
    return KVLayout(model=ident, block_size=int(block_size), dtype=dtype, arrangement=arrangement,
                    k_scale=k_scale, v_scale=v_scale,
                    tp_size=int(pc.tensor_parallel_size), tp_rank=int(tp_rank),
                    engine=f"vllm-cpu {vllm.__version__} {mc.model}")


def pin_cpu_attn_isa() -> bool:
    """Keep vLLM CPU's KV cache in the arrangement dlmix describes (``vllm_cpu``) on hosts with AMX.

    vLLM CPU picks a kernel ISA per attention group (``_get_attn_isa`` in ``vllm/v1/attention/backends/cpu_attn.py``):
    on a host with AMX tiles a bf16 cache (and an fp8 cache of a bf16 model) with a block size multiple of 32 gets
    ``"amx"``, whose pages hold K in 16-token groups of head-size pairs and V in token pairs (measured against the
    kernel by ``tests/test_kv_vllm_cpu_op.py``), not the transposed-K/row-major-V pages of ``"vec"``. dlmix does not
    describe the AMX tile layout yet, so an instance with DLMixConnector uses ``"vec"`` (the kernel hosts without AMX
    use for the same dtypes): the KV bytes it sends and receives are then the ones its descriptor names. Called by
    the connector before vLLM builds its attention backends (``ensure_kv_transfer_initialized`` runs before
    ``initialize_kv_cache``). Returns True when the ISA choice is pinned (idempotent), False without vLLM CPU's
    attention backend.
    """
    try:
        from vllm.v1.attention.backends import cpu_attn
    except Exception:  # noqa: BLE001 - no CPU attention backend in this vLLM build
        return False
    orig = getattr(cpu_attn, "_get_attn_isa", None)
    if orig is None:
        return False
    if getattr(orig, "_dlmix_pinned", False):
        return True

    def isa(*args: Any, **kwargs: Any) -> str:
        r = orig(*args, **kwargs)
        return "vec" if r == "amx" else r
    isa._dlmix_pinned = True  # type: ignore[attr-defined]
    isa.__wrapped__ = orig  # type: ignore[attr-defined]
    cpu_attn._get_attn_isa = isa
    return True


_LAYER_RE = re.compile(r"(\d+)")


def ordered_layers(kv_caches: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """Layers sorted by the first integer in their name (``model.layers.12.self_attn.attn`` -> 12), then name."""
    def key(item: tuple[str, torch.Tensor]):
        m = _LAYER_RE.search(item[0])
        return (int(m.group(1)) if m else -1, item[0])

    return sorted(kv_caches.items(), key=key)
