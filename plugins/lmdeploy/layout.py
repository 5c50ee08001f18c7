"""Describe an LMDeploy rank's KV cache as a :class:`dlmix.kv.KVLayout` and give its per-layer tensors.

LMDeploy 0.18's cache engine allocates the block cache through a layout its op backend chooses
(``pytorch/engine/cache_engine/layout.py``; arrangements in :mod:`dlmix.kv.arrangements.lmdeploy`):

* ``PackedBlockCacheLayout`` (the default and CUDA backends): one uint8 pool ``[L, B, K bytes + V bytes]``; a
  layer is ``pool[l]`` viewed ``[B, 2, N, H, D]`` -> arrangement ``lmdeploy_packed``;
* ``ContiguousBlockCacheLayout`` (the dlinfer backends: Ascend, MACA, CAMB): ``K [L, B, N, H, D]`` and
  ``V [L, B, N, H, D]`` -> arrangement ``lmdeploy`` (a layer is ``(K[l], V[l])``).

What is described is read from the allocation itself (pool shapes, tensor specs), not assumed. Refused with the
reason (ValueError): fp8 or TurboQuant KV (``--quant-policy`` other than 0, 4 and 8), MLA or non-standard caches,
extra block-cache payloads (state caches of linear-attention models), padded payloads, a kernel block size
that differs from the block size.

An int8 or int4 cache (``--quant-policy 8``: K and V uint8 ``[B, N, H, D]``; ``--quant-policy 4``: uint8
``[B, N, H, D/2]``, two values a byte; both plus ``k_scales_zeros``/``v_scales_zeros`` ``[B, N, H, 2]`` in the model
dtype, ``cache_engine/schema.py`` ``build_quant_cache_descs``) is described by :func:`describe_quant_cache` as what a
transfer carries: fp32 in the ``lmdeploy`` arrangement (exact for LMDeploy's read of such a cache), quantized on
arrival at a decode, dequantized into a copy of the blocks a prefill holds (:class:`QuantCache`, :mod:`dlmix.kv.quant`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dlmix.kv import KVLayout, ModelIdentity
from dlmix.pd.fingerprint import weights_fingerprint

__all__ = ["describe_cache", "describe_quant_cache", "quant_policy", "QuantCache"]

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


def _check_standard_cache(cache_config: Any, model_config: Any) -> None:
    """Raise ValueError unless the cache is standard K/V (not MLA or state caches) with a kernel block size equal to
    its block size: what both :func:`describe_cache` and :func:`describe_quant_cache` require."""
    if cache_config.block_size != cache_config.kernel_block_size:
        raise ValueError(f"block size {cache_config.block_size} != kernel block size "
                         f"{cache_config.kernel_block_size}")
    if not getattr(model_config, "use_standard_kv_cache", True):
        raise ValueError("the DLMix migration backend moves standard K/V caches only (not MLA or state caches)")


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
        raise ValueError(f"a --quant-policy {policy} cache is described by describe_quant_cache (4 and 8); the "
                         f"DLMix migration backend does not move fp8 or TurboQuant KV caches")
    _check_standard_cache(cc, model_config)
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
class QuantCache:
    """One rank's ``--quant-policy 8`` or ``4`` cache, per layer: ``k``/``v`` uint8 ``[B, N, H, D]`` (int8) or
    ``[B, N, H, D/2]`` (int4, two values a byte) and ``ksz``/``vsz`` (scale, zero) ``[B, N, H, 2]`` in ``dtype`` (the
    model dtype). A transfer into it lands in a :meth:`shadow` (fp32, ``lmdeploy`` arrangement, ``n`` blocks) and
    :meth:`store` quantizes it into the cache's blocks; a transfer out of it reads blocks that :meth:`load`
    dequantized into an :meth:`export_pool`.

    Why fp32 and not the model dtype: LMDeploy's read of a vector, ``(q - zero) * scale`` with ``q`` at most 255
    and ``scale``/``zero`` in fp16 or bf16, is exact in fp32, and quantizing those exact values again gives back the
    same ``q``, ``scale`` and ``zero`` (the span is ``levels * scale`` exactly). Rounded to the model dtype on the way
    they would come back with scales a last bit off, and a quantized decode fed by a quantized prefill would not
    hold the bytes its own prefill writes."""

    k: list[Any]
    v: list[Any]
    ksz: list[Any]
    vsz: list[Any]
    dtype: Any
    bits: int = 8

    @property
    def head_size(self) -> int:
        """Values per (token, head) vector: the payload's last dimension, doubled for int4."""
        d = int(self.k[0].shape[-1])
        return d * 2 if self.bits == 4 else d

    def shadow(self, n: int, *, zeroed: bool = True) -> list[tuple[Any, Any]]:
        """``n`` blocks per layer, ``(K, V)`` each ``[n, N, H, head_size]`` in fp32 (``L * 2 * n * N * H * head_size
        * 4`` bytes); zeroed unless ``zeroed`` is False."""
        import torch

        make = torch.zeros if zeroed else torch.empty
        shape = (n, *self.k[0].shape[1:-1], self.head_size)
        return [(make(shape, dtype=torch.float32), make(shape, dtype=torch.float32)) for _ in self.k]

    def export_pool(self) -> list[tuple[Any, Any]]:
        """An fp32 copy of every block's place (:meth:`shadow` of the pool's ``B`` blocks, not zeroed: the host only
        backs pages once :meth:`load` writes them), indexed by the engine's own block ids."""
        return self.shadow(int(self.k[0].shape[0]), zeroed=False)

    def store(self, shadow: list[tuple[Any, Any]], block_ids: list[int]) -> None:
        """Quantize ``shadow`` block ``i`` into cache block ``block_ids[i]``, every layer
        (:func:`dlmix.kv.quant.quantize_asym`, the formula of LMDeploy's own cache writes)."""
        import torch

        from dlmix.kv.quant import quantize_asym

        idx = torch.tensor([int(b) for b in block_ids], dtype=torch.long)
        n = len(block_ids)
        with torch.inference_mode():  # LMDeploy allocates its cache as inference tensors
            for layer, (ks, vs) in enumerate(shadow):
                for x, c, sz in ((ks, self.k[layer], self.ksz[layer]), (vs, self.v[layer], self.vsz[layer])):
                    q, s = quantize_asym(x[:n], self.dtype, self.bits)
                    c[idx] = q
                    sz[idx] = s

    def load(self, block_ids: list[int], pool: list[tuple[Any, Any]]) -> None:
        """Dequantize cache blocks ``block_ids`` into the same blocks of ``pool`` (an :meth:`export_pool`), every
        layer (:func:`dlmix.kv.quant.dequantize_asym`, LMDeploy's read: ``(q - zero) * scale``, exact in fp32)."""
        import torch

        from dlmix.kv.quant import dequantize_asym

        idx = torch.tensor([int(b) for b in block_ids], dtype=torch.long)
        with torch.inference_mode():
            for layer, (ko, vo) in enumerate(pool):
                for out, c, sz in ((ko, self.k[layer], self.ksz[layer]), (vo, self.v[layer], self.vsz[layer])):
                    out[idx] = dequantize_asym(c[idx], sz[idx], self.bits).to(out.dtype)


def describe_quant_cache(cache_engine: Any, model_config: Any, model_path: str, *, tp_rank: int, tp_size: int,
                         engine: str = "lmdeploy", receives: bool = True) -> tuple[KVLayout, QuantCache]:
    """``(layout, cache)`` of a ``--quant-policy 8`` or ``4`` rank: the layout a transfer into it (``receives``, a
    decode: quantized on arrival) or out of it (a prefill: dequantized while held) carries (fp32, see
    :class:`QuantCache`; the ``lmdeploy`` arrangement; its block size) and its :class:`QuantCache`.
    Raises ValueError when the cache is not LMDeploy's int8/int4 K/V with scales and zeros."""
    cc = cache_engine.cache_config
    policy = quant_policy(cache_engine)
    if policy not in (4, 8):
        raise ValueError(f"not an int8 or int4 (--quant-policy 8 or 4) KV cache: --quant-policy {policy}")
    _check_standard_cache(cc, model_config)
    specs = list(cache_engine.block_cache_plan.tensor_specs)
    names = [s.name for s in specs]
    if len(names) != 4 or names[:2] != ["k_cache", "v_cache"]:
        raise ValueError(f"an int{policy} KV cache of LMDeploy has K, V and their scales/zeros, this engine has "
                         f"{names}")
    k, v, ksz, vsz = (s.desc for s in specs)
    N, H, P = (int(x) for x in k.shape)
    if str(k.dtype) != "torch.uint8" or tuple(v.shape) != (N, H, P) or str(v.dtype) != "torch.uint8" \
            or tuple(ksz.shape) != (N, H, 2) or tuple(vsz.shape) != (N, H, 2) or ksz.dtype != vsz.dtype:
        raise ValueError(f"unexpected int{policy} KV payloads: K {k.shape} {k.dtype}, V {v.shape} {v.dtype}, "
                         f"scales {ksz.shape} {ksz.dtype} / {vsz.shape} {vsz.dtype}")
    dtype = _DTYPES.get(str(ksz.dtype))
    if dtype is None or N != cc.block_size:
        raise ValueError(f"int{policy} KV scales in {ksz.dtype}, block {N}: not a cache dlmix moves")
    views = list(cache_engine.gpu_allocation.tensor_views)
    if len(views) != 4 or any(t.dim() != 5 for t in views):
        raise ValueError(f"unknown LMDeploy int{policy} cache allocation (views {[tuple(t.shape) for t in views]})")
    L = int(model_config.num_layers)
    cache = QuantCache(*([t[i] for i in range(L)] for t in views), dtype=ksz.dtype, bits=policy)
    D = cache.head_size
    ident = _model_identity(model_config, model_path, L, H * int(tp_size), D)
    how = "quantized on arrival" if receives else "dequantized while held"
    layout = KVLayout(model=ident, block_size=N, dtype="fp32", arrangement="lmdeploy", tp_size=int(tp_size),
                      tp_rank=int(tp_rank), engine=f"{engine} {model_path} (int{policy} KV, {dtype} scales, {how})")
    return layout, cache
