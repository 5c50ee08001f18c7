"""Describe an LMDeploy rank's KV cache as a :class:`dlmix.kv.KVLayout` and give its per-layer tensors.

LMDeploy 0.18's cache engine allocates the block cache through a layout its op backend chooses
(``pytorch/engine/cache_engine/layout.py``; arrangements in :mod:`dlmix.kv.arrangements.lmdeploy`):

* ``PackedBlockCacheLayout`` (the default and CUDA backends): one uint8 pool ``[L, B, K bytes + V bytes]``; a
  layer is ``pool[l]`` viewed ``[B, 2, N, H, D]`` -> arrangement ``lmdeploy_packed``;
* ``ContiguousBlockCacheLayout`` (the dlinfer backends: Ascend, MACA, CAMB): ``K [L, B, N, H, D]`` and
  ``V [L, B, N, H, D]`` -> arrangement ``lmdeploy`` (a layer is ``(K[l], V[l])``).

What is described is read from the allocation itself (pool shapes, tensor specs), not assumed. Refused with the
reason (ValueError): KV quantization (``--quant-policy`` 4/8 and fp8 payload scales), MLA or non-standard caches,
extra block-cache payloads (state caches of linear-attention models), padded payloads, a kernel block size that differs
from the block size.
"""
from __future__ import annotations

from typing import Any

from dlmix.kv import KVLayout, ModelIdentity
from dlmix.pd.fingerprint import weights_fingerprint

__all__ = ["describe_cache"]

_DTYPES = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}


def _model_identity(model_config: Any, model_path: str, num_layers: int, kv_heads: int, head_size: int
                    ) -> ModelIdentity:
    hf = getattr(model_config, "hf_config", None)
    archs = list(getattr(hf, "architectures", None) or [])
    attn_heads = int(getattr(model_config, "num_attention_heads", -1))
    return ModelIdentity(architecture=archs[0] if archs else "unknown", num_layers=num_layers,
                         num_kv_heads=kv_heads, head_size=head_size,
                         attention="mha" if kv_heads == attn_heads else "gqa",
                         weights_fingerprint=weights_fingerprint(str(model_path)))


def describe_cache(cache_engine: Any, model_config: Any, model_path: str, *, tp_rank: int, tp_size: int,
                   engine: str = "lmdeploy") -> tuple[KVLayout, list[Any]]:
    """``(layout, per-layer caches)`` of one LMDeploy rank.

    Args:
      cache_engine: LMDeploy's ``CacheEngine`` (``cache_config``, ``block_cache_plan``, ``gpu_allocation``).
      model_config: LMDeploy's ``ModelConfig`` (``num_layers``, ``num_key_value_heads``, ``head_dim``, ``hf_config``).
      model_path: the served model folder (weights fingerprint).
      tp_rank, tp_size: this rank's attention TP rank and size.
    Returns the layout (block size = LMDeploy's ``--cache-block-seq-len``, dtype of the K payload, TP) and one cache
    per layer in :mod:`dlmix.kv` form: ``[B, 2, N, H, D]`` views of the packed pool, or ``(K[l], V[l])``.
    Raises ValueError for caches the backend does not move (module doc).
    """
    cc = cache_engine.cache_config
    policy = int(getattr(cc.quant_policy, "value", cc.quant_policy) or 0)
    if policy:
        raise ValueError(f"the DLMix migration backend does not move quantized KV caches yet (--quant-policy "
                         f"{policy}); run both sides with --quant-policy 0")
    if cc.block_size != cc.kernel_block_size:
        raise ValueError(f"block size {cc.block_size} != kernel block size {cc.kernel_block_size}")
    if not getattr(model_config, "use_standard_kv_cache", True):
        raise ValueError("the DLMix migration backend moves standard K/V caches only (not MLA or state caches)")
    specs = list(cache_engine.block_cache_plan.tensor_specs)
    names = [s.name for s in specs]
    if names != ["k_cache", "v_cache"]:
        raise ValueError(f"the DLMix migration backend moves caches of exactly a K and a V payload, this engine "
                         f"has {names}")
    k, v = (s.desc for s in specs)
    if tuple(k.shape) != tuple(v.shape) or k.dtype != v.dtype:
        raise ValueError(f"K payload {tuple(k.shape)} {k.dtype} and V payload {tuple(v.shape)} {v.dtype} differ")
    dtype = _DTYPES.get(str(k.dtype))
    if dtype is None:
        raise ValueError(f"KV cache dtype {k.dtype} is not moved by the DLMix migration backend (fp32, bf16, fp16)")
    N, H, D = (int(x) for x in k.shape)
    if N != cc.block_size:
        raise ValueError(f"K payload {tuple(k.shape)} does not start with the block size {cc.block_size}")
    L = int(model_config.num_layers)
    pools = list(cache_engine.gpu_allocation.pools)
    views = list(cache_engine.gpu_allocation.tensor_views)
    if len(pools) == 1 and len(views) == 2 and pools[0].tensor.dim() == 3:
        pool = pools[0].tensor  # [L, B, bytes]
        if k.aligned_size != k.size or v.aligned_size != v.size or pool.shape[2] != k.size + v.size:
            raise ValueError(f"packed KV payloads are padded (K {k.size}->{k.aligned_size} B, V {v.size}->"
                             f"{v.aligned_size} B): not a layout dlmix describes")
        B = int(pool.shape[1])
        layers = [pool[i].view(k.dtype).view(B, 2, N, H, D) for i in range(L)]
        arrangement = "lmdeploy_packed"
    elif len(views) == 2 and all(t.dim() == 5 and t.is_contiguous() for t in views):
        kt, vt = views
        layers = [(kt[i], vt[i]) for i in range(L)]
        arrangement = "lmdeploy"
    else:
        raise ValueError(f"unknown LMDeploy cache allocation ({len(pools)} pools, views "
                         f"{[tuple(t.shape) for t in views]}): not a layout dlmix describes")
    ident = _model_identity(model_config, model_path, L, H * int(tp_size), D)
    layout = KVLayout(model=ident, block_size=N, dtype=dtype, arrangement=arrangement, tp_size=int(tp_size),
                      tp_rank=int(tp_rank), engine=f"{engine} {model_path}")
    return layout, layers
