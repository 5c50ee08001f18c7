"""Pure-torch op backend for LMDeploy's PyTorch engine on the host (the CPU test aid, :mod:`dlmix_lmdeploy.cpu`).

Everything but paged attention and the step context comes from LMDeploy's own ``DefaultOpsBackend``
(``pytorch/backends/default``); those two exist upstream only as triton or dlinfer kernels. The KV cache keeps
LMDeploy's default (CUDA) block layout, so the DLMix backend moves the same arrangement on the host as on a GPU.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from lmdeploy.pytorch.backends.attention import AttentionImpl, AttentionMetadata, PagedAttentionBuildSpec
from lmdeploy.pytorch.backends.default import DefaultOpsBackend
from lmdeploy.pytorch.backends.default.linear import DefaultLinearImpl
from lmdeploy.pytorch.backends.linear import LinearBuildSpec

from dlmix.kv.quant import dequantize_asym, quantize_asym
from dlmix.testing.cpu_gemm import slow_gemm_dtypes, wants_fp32

__all__ = ["CpuPagedAttention", "CpuLinear", "CpuOpsBackend"]

#: query rows per attention call. A whole 1,000-token prompt in one masked call builds its ``[heads, 1000, 1000]``
#: score matrix and computes the masked-out half too; 64 rows a call (each over only the keys it may see) measured
#: 3.6x faster on one AVX2 core (36.7 against 133 ms per layer, SmolLM2's 9 heads of 64) and equal to 2.4e-7.
_Q_ROWS = 64


class CpuLinear(DefaultLinearImpl):
    """LMDeploy's default linear, except that a 16-bit product this CPU has no native GEMM for is computed in fp32
    and rounded to its dtype once (:mod:`dlmix.testing.cpu_gemm`: which dtypes, from how many rows, and why; on an
    AVX2-only CPU a bf16 or fp16 prefill otherwise runs several times slower than it has to).

    Shapes: ``x`` ``[..., in_features]``, ``weight`` ``[out_features, in_features]``, ``bias`` ``[out_features]``;
    returns ``[..., out_features]`` in ``x``'s dtype.
    """

    #: the dtypes this process upcasts (:func:`dlmix.testing.cpu_gemm.slow_gemm_dtypes`)
    upcast = slow_gemm_dtypes()

    def forward(self, x, weight, bias=None, all_reduce=False, group=None, rank=0, scatter_size=None):
        if wants_fp32(x, self.upcast):
            return super().forward(x.float(), weight.float(), None if bias is None else bias.float(), all_reduce,
                                   group, rank, scatter_size).to(x.dtype)
        return super().forward(x, weight, bias, all_reduce, group, rank, scatter_size)


class CpuPagedAttention(AttentionImpl[AttentionMetadata]):
    """Reference paged attention: write this step's K/V into the sequence's blocks, gather the sequence's blocks,
    causal softmax attention in fp32, one sequence at a time and :data:`_Q_ROWS` query rows a product. The query heads
    that share a KV head are multiplied with it together (grouped-query attention without copying K/V per query
    head). A decode step over 1,000 tokens (SmolLM2's 9 heads over 3 KV heads of 64, one AVX2 core) measured 0.38
    against 1.94 ms per layer with ``repeat_interleave``, a per-position gather and torch's SDPA (fp16 cache; int8:
    1.00 against 4.62 ms); a 1,000-token prefill 27 against 36 ms.

    Shapes: ``query`` ``[tokens, heads, head_dim]``; ``key``/``value`` ``[tokens, kv_heads, head_dim]``;
    ``k_cache``/``v_cache`` ``[num_blocks, block_size, kv_heads, head_dim]`` (views, may be strided). With
    ``--quant-policy 8`` the caches are uint8 (``--quant-policy 4``: uint8 ``[..., head_dim / 2]``, two 4-bit values
    a byte) and ``k_scales_zeros``/``v_scales_zeros`` ``[num_blocks, block_size, kv_heads, 2]`` hold each vector's
    scale and zero point: written and read with :mod:`dlmix.kv.quant` (LMDeploy's formulas). Other quantized
    policies (fp8, TurboQuant) raise NotImplementedError.
    """

    def forward(self, query, key, value, k_cache, v_cache, attn_metadata, k_scales_zeros=None,
                v_scales_zeros=None, learnable_sink=None, nsa_indices=None, inplace=False, **kwargs):
        if learnable_sink is not None or nsa_indices is not None or self.alibi or self.logit_softcapping:
            raise NotImplementedError("the CPU aid implements plain causal/non-causal attention only")
        quant = int(getattr(attn_metadata.quant_policy, "value", attn_metadata.quant_policy) or 0)
        if quant not in (0, 4, 8):
            raise NotImplementedError(f"the CPU aid implements KV --quant-policy 0, 4 and 8, not {quant}")
        if quant and (k_scales_zeros is None or v_scales_zeros is None):
            raise ValueError(f"--quant-policy {quant} needs the caches' scales and zeros (k_scales_zeros, "
                             "v_scales_zeros)")
        block_size = k_cache.size(1)
        q_lens = attn_metadata.q_seqlens.tolist()
        kv_lens = attn_metadata.kv_seqlens.tolist()
        out = query.new_zeros(query.shape[:-1] + (self.v_head_size,))
        kvh, groups = self.num_kv_heads, self.num_heads // self.num_kv_heads
        start = 0
        for b, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens)):
            if q_len and kv_len:
                table = attn_metadata.block_offsets[b]
                history = kv_len - q_len
                if key is not None:
                    pos = torch.arange(history, kv_len)
                    blk, off = table[pos // block_size].long(), pos % block_size
                    if quant:
                        for x, c, sz in ((key, k_cache, k_scales_zeros), (value, v_cache, v_scales_zeros)):
                            c[blk, off], sz[blk, off] = quantize_asym(x[start:start + q_len], sz.dtype, quant)
                    else:
                        k_cache[blk, off] = key[start:start + q_len].to(k_cache.dtype)
                        v_cache[blk, off] = value[start:start + q_len].to(v_cache.dtype)
                # whole blocks by index_select (a per-position gather is 8x slower), cut to the sequence's tokens
                blocks = table[:(kv_len + block_size - 1) // block_size].long()

                def gather(cache, sz):
                    x = cache.index_select(0, blocks)
                    x = dequantize_asym(x, sz.index_select(0, blocks), quant) if quant else x.float()
                    return x.flatten(0, 1)[:kv_len]  # [kv_len, kv_heads, head_dim]

                k = gather(k_cache, k_scales_zeros).transpose(0, 1)  # [kv_heads, kv_len, head_dim] (a view)
                v = gather(v_cache, v_scales_zeros).transpose(0, 1)  # [kv_heads, kv_len, v_head_dim]
                # the query heads of one KV head stacked as rows of one product with it: each KV head is read once
                q = query[start:start + q_len].float().view(q_len, kvh, groups, -1).permute(1, 2, 0, 3)
                for i in range(0, q_len, _Q_ROWS):  # causal: rows i..j-1 see keys 0..history+j-1 only
                    j = min(q_len, i + _Q_ROWS)
                    n_kv = history + j if self.causal else kv_len
                    rows = q[:, :, i:j].reshape(kvh, groups * (j - i), -1)
                    s = torch.bmm(rows, k[:, :n_kv].transpose(1, 2)).mul_(self.scale)  # [kvh, groups*rows, n_kv]
                    if self.causal and j - i > 1:
                        keep = torch.arange(n_kv)[None, :] <= (history + torch.arange(i, j))[:, None]
                        s.view(kvh, groups, j - i, n_kv).masked_fill_(~keep, float("-inf"))
                    o = torch.bmm(s.softmax(-1), v[:, :n_kv]).view(kvh, groups, j - i, -1)
                    out[start + i:start + j] = o.permute(2, 0, 1, 3).flatten(1, 2).to(out.dtype)
            start += q_len
        return out


class CpuOpsBackend(DefaultOpsBackend):
    """LMDeploy's default op backend plus :class:`CpuPagedAttention` and :class:`CpuLinear`; collective backend gloo,
    one device."""

    @staticmethod
    def get_name() -> str:
        return "cpu"

    @classmethod
    def build_op(cls, spec, *, enable_deterministic: bool = False):
        if isinstance(spec, PagedAttentionBuildSpec):
            if spec.sliding_window not in (None, -1, (-1, -1)):
                raise NotImplementedError("the CPU aid has no sliding-window attention")
            return CpuPagedAttention(num_heads=spec.num_heads, head_size=spec.head_dim, scale=spec.scale,
                                     num_kv_heads=spec.num_kv_heads, v_head_size=spec.v_head_dim,
                                     alibi=spec.alibi, sliding_window=spec.sliding_window,
                                     logit_softcapping=spec.logit_softcapping, causal=spec.causal)
        if type(spec) is LinearBuildSpec:
            return CpuLinear()
        return super().build_op(spec, enable_deterministic=enable_deterministic)

    @staticmethod
    def get_attention_metadata_cls():
        return AttentionMetadata

    @classmethod
    def update_step_context(cls, step_context):
        q_lens = step_context.q_seqlens
        step_context.attn_metadata = AttentionMetadata(
            is_decoding=step_context.is_decoding,
            block_offsets=step_context.block_offsets,
            q_start_loc=step_context.q_start_loc,
            q_seqlens=q_lens,
            kv_seqlens=step_context.kv_seqlens,
            cu_seqlens_q=F.pad(torch.cumsum(q_lens, dim=0, dtype=torch.int32), (1, 0)),
            quant_policy=step_context.kv_quant_policy,
        )
        return step_context

    @staticmethod
    def ccl_backend() -> str:
        return "gloo"

    @staticmethod
    def device_count():
        return 1
