"""Describe an LMDeploy rank's KV cache as a :class:`dlmix.kv.KVLayout` and give its per-layer tensors.

LMDeploy 0.18's cache engine allocates the block cache through a layout its op backend chooses
(``pytorch/engine/cache_engine/layout.py``; arrangements in :mod:`dlmix.kv.arrangements.lmdeploy`):

* ``PackedBlockCacheLayout`` (the default and CUDA backends): one uint8 pool ``[L, B, K bytes + V bytes]``; a
  layer is ``pool[l]`` viewed ``[B, 2, N, H, D]`` -> arrangement ``lmdeploy_packed``;
* ``ContiguousBlockCacheLayout`` (the dlinfer backends: Ascend, MACA, CAMB): ``K [L, B, N, H, D]`` and
  ``V [L, B, N, H, D]`` -> arrangement ``lmdeploy`` (a layer is ``(K[l], V[l])``).

What is described is read from the allocation itself (pool shapes, tensor specs), not assumed. Refused with the
reason (ValueError): KV quantization other than ``--quant-policy 8`` (4, fp8 payload scales), MLA or non-standard
caches, extra block-cache payloads (state caches of linear-attention models), padded payloads, a kernel block size
that differs from the block size.

An int8 cache (``--quant-policy 8``: K and V uint8 ``[B, N, H, D]`` plus ``k_scales_zeros``/``v_scales_zeros``
``[B, N, H, 2]`` in the model dtype, ``cache_engine/schema.py`` ``build_quant_cache_descs``) is described by
:func:`describe_int8_cache` as what a transfer into it carries: the model dtype in the ``lmdeploy`` arrangement,
quantized on arrival (:class:`Int8Cache`, :mod:`dlmix.kv.quant`). Only a receiving (Decode) rank has one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dlmix.kv import KVLayout, ModelIdentity
from dlmix.pd.fingerprint import weights_fingerprint

__all__ = ["describe_cache", "describe_int8_cache", "quant_policy", "Int8Cache"]

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


def quant_policy(cache_engine: Any) -> int:
    """LMDeploy's ``--quant-policy`` of this cache (0 none, 4/8 int4/int8, fp8 ones)."""
    cc = cache_engine.cache_config
    return int(getattr(cc.quant_policy, "value", cc.quant_policy) or 0)


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
    policy = quant_policy(cache_engine)
    if policy:
        raise ValueError(f"the DLMix migration backend moves KV caches of --quant-policy 0, and receives into "
                         f"--quant-policy 8 on a decode engine, not --quant-policy {policy} here")
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


@dataclass
class Int8Cache:
    """One rank's ``--quant-policy 8`` cache, per layer: ``k``/``v`` uint8 ``[B, N, H, D]`` and ``ksz``/``vsz``
    (scale, zero) ``[B, N, H, 2]`` in ``dtype`` (the model dtype). A transfer lands in a :meth:`shadow` (the model
    dtype, ``lmdeploy`` arrangement, ``n`` blocks) and :meth:`store` quantizes it into the cache's blocks."""

    k: list[Any]
    v: list[Any]
    ksz: list[Any]
    vsz: list[Any]
    dtype: Any

    def shadow(self, n: int) -> list[tuple[Any, Any]]:
        """``n`` zeroed blocks per layer, ``(K, V)`` each ``[n, N, H, D]`` in the model dtype
        (``L * 2 * n * N * H * D * itemsize`` bytes)."""
        import torch

        shape = (n, *self.k[0].shape[1:])
        return [(torch.zeros(shape, dtype=self.dtype), torch.zeros(shape, dtype=self.dtype)) for _ in self.k]

    def store(self, shadow: list[tuple[Any, Any]], block_ids: list[int]) -> None:
        """Quantize ``shadow`` block ``i`` into cache block ``block_ids[i]``, every layer
        (:func:`dlmix.kv.quant.quantize_int8_asym`, the formula of LMDeploy's own cache writes)."""
        import torch

        from dlmix.kv.quant import quantize_int8_asym

        idx = torch.tensor([int(b) for b in block_ids], dtype=torch.long)
        n = len(block_ids)
        with torch.inference_mode():  # LMDeploy allocates its cache as inference tensors
            for layer, (ks, vs) in enumerate(shadow):
                for x, c, sz in ((ks, self.k[layer], self.ksz[layer]), (vs, self.v[layer], self.vsz[layer])):
                    q, s = quantize_int8_asym(x[:n], self.dtype)
                    c[idx] = q
                    sz[idx] = s


def describe_int8_cache(cache_engine: Any, model_config: Any, model_path: str, *, tp_rank: int, tp_size: int,
                        engine: str = "lmdeploy") -> tuple[KVLayout, Int8Cache]:
    """``(layout, cache)`` of a ``--quant-policy 8`` rank: the layout a transfer into it is converted to (the model
    dtype of its scales, the ``lmdeploy`` arrangement, its block size) and its :class:`Int8Cache`.
    Raises ValueError when the cache is not LMDeploy's int8 K/V with scales and zeros."""
    cc = cache_engine.cache_config
    if quant_policy(cache_engine) != 8:
        raise ValueError("not an int8 (--quant-policy 8) KV cache")
    if cc.block_size != cc.kernel_block_size:
        raise ValueError(f"block size {cc.block_size} != kernel block size {cc.kernel_block_size}")
    specs = list(cache_engine.block_cache_plan.tensor_specs)
    names = [s.name for s in specs]
    if len(names) != 4 or names[:2] != ["k_cache", "v_cache"]:
        raise ValueError(f"an int8 KV cache of LMDeploy has K, V and their scales/zeros, this engine has {names}")
    k, v, ksz, vsz = (s.desc for s in specs)
    N, H, D = (int(x) for x in k.shape)
    if str(k.dtype) != "torch.uint8" or tuple(v.shape) != (N, H, D) or str(v.dtype) != "torch.uint8" \
            or tuple(ksz.shape) != (N, H, 2) or tuple(vsz.shape) != (N, H, 2) or ksz.dtype != vsz.dtype:
        raise ValueError(f"unexpected int8 KV payloads: K {k.shape} {k.dtype}, V {v.shape} {v.dtype}, scales "
                         f"{ksz.shape} {ksz.dtype} / {vsz.shape} {vsz.dtype}")
    dtype = _DTYPES.get(str(ksz.dtype))
    if dtype is None or N != cc.block_size:
        raise ValueError(f"int8 KV scales in {ksz.dtype}, block {N}: not a cache dlmix receives into")
    views = list(cache_engine.gpu_allocation.tensor_views)
    if len(views) != 4 or any(t.dim() != 5 for t in views):
        raise ValueError(f"unknown LMDeploy int8 cache allocation (views {[tuple(t.shape) for t in views]})")
    L = int(model_config.num_layers)
    cache = Int8Cache(*([t[i] for i in range(L)] for t in views), dtype=ksz.dtype)
    ident = _model_identity(model_config, model_path, L, H * int(tp_size), D)
    layout = KVLayout(model=ident, block_size=N, dtype=dtype, arrangement="lmdeploy", tp_size=int(tp_size),
                      tp_rank=int(tp_rank), engine=f"{engine} {model_path} (int8 KV, quantized on arrival)")
    return layout, cache
