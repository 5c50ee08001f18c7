"""vLLM CPU attention (``CPU_ATTN``) cache ``[B, H, N, 2*D]`` whose pages hold K transposed.

Source: vLLM 0.32 ``vllm/v1/attention/backends/cpu_attn.py``: the layer tensor is ``[B, H, N, 2*D]`` (layout
``LBHNC``) but ``CPUAttentionBackendImpl.forward`` views each ``(block, head)`` page of ``2*N*D`` elements as
``[2N, D]`` and ``chunk(2, dim=2)`` into key and value caches that ``ops.cpu_attn_reshape_and_cache`` fills with K
**transposed** ``[D][N]`` followed by V row-major ``[N][D]`` (checked against the real kernel by
``tests/test_kv_vllm_cpu_op.py``). ``get_supported_kernel_block_sizes`` = ``[MultipleOf(32)]``.
"""

from __future__ import annotations

from typing import Any

from ..registry import Arrangement, register


@register("vllm_cpu")
class VllmCPU(Arrangement):
    """``[B, H, N, 2*D]``; inside each (block, head) page: K as ``[D][N]``, then V as ``[N][D]``."""

    def layer_shape(self, B: int, N: int, H: int, D: int) -> tuple[int, ...]:
        return (B, H, N, 2 * D)

    def check_layout(self, layout: Any) -> None:
        if layout.block_size % 32:
            raise ValueError(f"vllm_cpu (CPU_ATTN) needs a block size multiple of 32, got {layout.block_size}")

    def plane_views(self, cache: Any, N: int, H: int, D: int) -> tuple[Any, ...]:
        B = self.num_blocks_of(cache)
        self.expect_shape(cache, self.layer_shape(B, N, H, D))
        if cache.stride(3) != 1 or cache.stride(2) != 2 * D:
            raise ValueError("vllm_cpu pages must be dense: [..., N, 2*D] with strides (2*D, 1)")
        s0, s1, off = cache.stride(0), cache.stride(1), cache.storage_offset()
        # K^T inside the (block, head) page: element (b, h, d, n) at b*s0 + h*s1 + d*N + n
        k = cache.as_strided((B, N, H, D), (s0, 1, s1, N), off)
        # V row-major after K: element (b, h, n, d) at b*s0 + h*s1 + N*D + n*D + d
        v = cache.as_strided((B, N, H, D), (s0, D, s1, 1), off + N * D)
        return (k, v)
