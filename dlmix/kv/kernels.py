"""Compiled CPU loops (numba, optional) for the conversions no copy primitive does in one pass.

Two conversions cost far more than a copy when built from torch/numpy primitives on a CPU: fp8 re-encoding (a table
lookup per element: ``numpy.take`` ~0.16x of a flat copy) and re-arrangements that transpose elements inside a block
(vLLM CPU's K^T pages: a strided ``copy_`` of 2-byte elements ~0.23x). Here each is one compiled loop over the
request's block pairs, reading the source and writing the destination once:

* :func:`lookup_runs`: ``dst[d + i, h, e] = table[src[a + i, h, e]]`` for every run ``(a, d, k)`` of token rows
  (the table of :func:`dlmix.kv.cast._table`, so the bytes equal :func:`dlmix.kv.cast.cast_plane`'s);
* :func:`copy_blocks`: element copy of whole blocks between two strided ``[B, N, h, D]`` plane views given as a
  flat array of the engine tensor plus element strides, innermost loop along the source's dense axis (a run dense
  on both sides is moved as 8-byte words).

numba is a dependency of vLLM's CPU build and of the ``torch`` extra; without it (or with ``DLMIX_KV_NO_NUMBA=1``)
:data:`AVAILABLE` is False and the callers keep their torch/numpy paths (same bytes, slower). Loops compile on first
use (~3 s each; cached on disk by numba next to this file or in ``NUMBA_CACHE_DIR``) and release the GIL. Indices come from block tables validated by :mod:`dlmix.kv.plan`; the
loops do no bounds checks.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import numpy as np

#: True when the compiled loops can be used: numba is installed and ``DLMIX_KV_NO_NUMBA`` is unset or ``0``.
#: numba itself is imported on the first call of a loop, not with this module.
AVAILABLE = (os.environ.get("DLMIX_KV_NO_NUMBA", "0") in ("", "0")
             and importlib.util.find_spec("numba") is not None)


class _Lazy:
    """A function compiled with ``numba.njit`` on its first call (numba imported then)."""

    def __init__(self, fn: Any) -> None:
        self.fn, self.compiled = fn, None

    def __call__(self, *args: Any) -> Any:
        if self.compiled is None:
            import numba

            self.compiled = numba.njit(nogil=True, cache=True, boundscheck=False)(self.fn)
        return self.compiled(*args)


def _jit(fn: Any) -> Any:
    return _Lazy(fn)


@_jit
def _lookup_runs(table: np.ndarray, src: np.ndarray, dst: np.ndarray, runs: np.ndarray) -> None:  # pragma: no cover
    H, D = src.shape[1], src.shape[2]
    for r in range(runs.shape[0]):
        a, d, k = runs[r, 0], runs[r, 1], runs[r, 2]
        for i in range(k):
            for h in range(H):
                for e in range(D):
                    dst[d + i, h, e] = table[src[a + i, h, e]]


def lookup_runs(table: np.ndarray, src: np.ndarray, dst: np.ndarray, runs: np.ndarray) -> None:
    """``dst[d + i] = table[src[a + i]]`` elementwise for every row run ``(a, d, k)`` of ``runs`` (int64 ``[R, 3]``).

    ``src``: token rows ``[S, h, D]`` of unsigned integers (the source bit patterns, any strides); ``dst``:
    ``[T, h, D]`` of ``table``'s dtype (any strides); ``table``: 1-D, one entry per source bit pattern. Rows must lie
    inside both arrays (not checked).
    """
    _lookup_runs(table, src, dst, runs)


@_jit
def _copy_blocks(srcs: Any, dst: np.ndarray, s_off: np.ndarray, d_off: np.ndarray, pairs: np.ndarray,
                 shape: np.ndarray, ss: np.ndarray, ds: np.ndarray) -> None:  # pragma: no cover
    A1, A2 = shape[0, 0], shape[0, 1]
    R = len(srcs)
    u = np.uint64  # unsigned indices: numba then skips the negative-index wrap-around (measured ~2.5x)
    # strides and extents copied out of the arrays first: stores into ``dst`` would otherwise force reloads
    A3s = shape[:, 2].copy()
    sss, dss = ss.copy(), ds.copy()
    so_, do_ = s_off.copy(), d_off.copy()
    for p in range(pairs.shape[0]):
        dblk = pairs[p, R]
        for i in range(A1):
            for j in range(A2):
                for r in range(R):  # every source's part of this row before the next row: writes stream
                    src = srcs[r]
                    A3 = A3s[r]
                    s3, d3 = sss[r, 3], dss[r, 3]
                    so = so_[r] + pairs[p, r] * sss[r, 0] + i * sss[r, 1] + j * sss[r, 2]
                    do = do_[r] + dblk * dss[r, 0] + i * dss[r, 1] + j * dss[r, 2]
                    if s3 == 1 and d3 == 1:  # unit strides: LLVM vectorizes this loop
                        for k in range(A3):
                            dst[u(do + k)] = src[u(so + k)]
                    else:
                        for k in range(A3):
                            dst[u(do + k * d3)] = src[u(so + k * s3)]


@_jit
def _transpose_blocks(src: np.ndarray, dst: np.ndarray, s_off: int, d_off: int, pairs: np.ndarray, shape: np.ndarray,
                      ss: np.ndarray, ds: np.ndarray, per: int) -> None:  # pragma: no cover
    # every bound and stride in a local (stores into ``dst`` would otherwise force reloads from the arrays); all
    # in 8-byte words: a word holds ``per`` elements along k (source) or along j (destination)
    A1, A2, A3 = shape[0], shape[1], shape[2]
    s0, s1, s2 = ss[0] // per, ss[1] // per, ss[2] // per
    d0, d1, d3 = ds[0] // per, ds[1] // per, ds[3] // per
    so0, do0 = s_off // per, d_off // per
    u = np.uint64
    M16, M32 = u(0x0000FFFF0000FFFF), u(0x00000000FFFFFFFF)
    for p in range(pairs.shape[0]):
        bs = so0 + pairs[p, 0] * s0
        bd = do0 + pairs[p, 1] * d0
        for i in range(A1):
            for k in range(A3 // per):
                sk = bs + i * s1 + k
                dk = bd + i * d1 + k * per * d3
                for jw in range(A2 // per):  # one per x per tile: ``per`` words in, ``per`` words out
                    sj = sk + jw * per * s2
                    dj = dk + jw
                    if per == 4:  # 16-bit elements: 2x2 swaps of 16-bit, then of 32-bit halves
                        w0, w1 = src[u(sj)], src[u(sj + s2)]
                        w2, w3 = src[u(sj + 2 * s2)], src[u(sj + 3 * s2)]
                        t0 = (w0 & M16) | ((w1 & M16) << u(16))
                        t1 = ((w0 >> u(16)) & M16) | (w1 & ~M16)
                        t2 = (w2 & M16) | ((w3 & M16) << u(16))
                        t3 = ((w2 >> u(16)) & M16) | (w3 & ~M16)
                        dst[u(dj)] = (t0 & M32) | (t2 << u(32))
                        dst[u(dj + d3)] = (t1 & M32) | (t3 << u(32))
                        dst[u(dj + 2 * d3)] = (t0 >> u(32)) | (t2 & ~M32)
                        dst[u(dj + 3 * d3)] = (t1 >> u(32)) | (t3 & ~M32)
                    else:  # 32-bit elements
                        w0, w1 = src[u(sj)], src[u(sj + s2)]
                        dst[u(dj)] = (w0 & M32) | (w1 << u(32))
                        dst[u(dj + d3)] = (w0 >> u(32)) | (w1 & ~M32)


def transpose_blocks(src_words: np.ndarray, dst_words: np.ndarray, s_off: int, d_off: int, pairs: np.ndarray,
                     shape: tuple[int, int, int], s_strides: tuple[int, ...], d_strides: tuple[int, ...],
                     itemsize: int) -> None:
    """:func:`copy_blocks` for one source whose innermost axis ``k`` is dense while the destination is dense along
    ``j`` (a transpose inside each block, e.g. vLLM CPU's K^T pages), for 2- and 4-byte elements: tiles of
    ``p x p`` elements (``p = 8 // itemsize``) are read as ``p`` 8-byte words along ``k``, transposed with shifts
    and masks, and written as ``p`` words along ``j`` (measured on the 2-core dev box ~2x the element loop).
    Both arrays are flat ``uint64`` views; offsets and strides are in elements and must be whole words
    (``s_strides[3] == d_strides[2] == 1``; ``shape[1]``, ``shape[2]``, offsets and the other strides multiples
    of ``p``). Every address must lie inside the arrays (not checked).
    """
    _transpose_blocks(src_words, dst_words, s_off, d_off, pairs, np.asarray(shape, dtype=np.int64),
                      np.asarray(s_strides, dtype=np.int64), np.asarray(d_strides, dtype=np.int64), 8 // itemsize)


def copy_blocks(srcs: tuple[np.ndarray, ...], dst: np.ndarray, s_off: list[int], d_off: list[int],
                pairs: np.ndarray, shapes: list[tuple[int, int, int]], s_strides: list[tuple[int, ...]],
                d_strides: list[tuple[int, ...]]) -> None:
    """Copy whole blocks from one or more sources into one destination, all given as flat 1-D arrays of one
    element type (TP re-sharding: one source per rank, each filling its heads of every destination row).

    Row ``p`` of ``pairs`` (int64 ``[P, R + 1]``) is ``(block of source 0, ..., block of source R-1, destination
    block)``. For source ``r`` and every index ``(i, j, k)`` of ``shapes[r]``: ``dst[d_off[r] + dst_block*ds[0] +
    i*ds[1] + j*ds[2] + k*ds[3]] = srcs[r][s_off[r] + src_block*ss[0] + i*ss[1] + j*ss[2] + k*ss[3]]`` with
    ``ss = s_strides[r]``, ``ds = d_strides[r]`` (offsets and strides in elements). Every source must share the
    first two extents of its shape. The loops run ``i``, ``j``, then each source's ``k`` run, so a destination row
    is written in one sweep. The caller orders the axes so ``k`` is the source's dense one (reads stream;
    measured on the 2-core dev box for vLLM CPU's K^T pages: 4 GB/s against 1.1 GB/s with the destination's dense
    axis innermost). Every address must lie inside the arrays (not checked).
    """
    if any(tuple(sh[:2]) != tuple(shapes[0][:2]) for sh in shapes):
        raise ValueError(f"sources must share the outer extents of their shapes, got {shapes}")
    _copy_blocks(tuple(srcs), dst, np.asarray(s_off, dtype=np.int64), np.asarray(d_off, dtype=np.int64), pairs,
                 np.asarray(shapes, dtype=np.int64).reshape(-1, 3), np.asarray(s_strides, dtype=np.int64),
                 np.asarray(d_strides, dtype=np.int64))
