"""KV conversion throughput next to a plain tensor copy of the same bytes, measured side by side.

Cases (Llama-3-8B KV shape: 32 layers, 8 KV heads, head size 128; one request of ``--mib`` MiB of KV at the
destination, scattered over shuffled block ids in larger pools), one per kind of conversion:

* ``identity``: vLLM FlashAttention NHD, bf16, block 32 -> the same layout (whole-block copies);
* ``rechunk``: block size 32 -> 128, same arrangement and dtype;
* ``pack`` / ``unpack``: the wire path for the rechunk pair (source blocks -> wire buffer, wire buffer ->
  destination blocks, chunk by chunk as a 64 MiB staging buffer would carry them); each moves every byte once;
* ``cast``: bf16 -> fp32, same arrangement and block size. Bytes counted: the **destination** (fp32) side;
* ``fp8``: bf16 -> fp8_e4m3 with per-tensor scales 0.5/0.25 (bytes counted: the bf16 source side);
* ``nhd_to_hnd`` / ``hnd_to_nhd``: vLLM FlashAttention NHD <-> HND, same block size and dtype;
* ``to_vllm_cpu``: NHD -> vLLM CPU (K transposed inside each page), same block size;
* ``vllm_cpu_rechunk``: vLLM CPU block 32 -> vLLM CPU block 64 (the decode side of a vLLM CPU PD pair whose block
  sizes differ);
* ``reshard``: prefill TP=2 (two ranks of 4 heads) -> decode TP=1 (8 heads), bytes = destination bytes.

Bytes counted: the larger side of the conversion (for ``cast`` the fp32 destination, for ``fp8`` the bf16 source;
otherwise both sides are equal), so the baseline copy moves at least as many bytes as the conversion reads or
writes, and a conversion is never credited with bytes it did not touch.

Baseline: ``dst.copy_(src)`` between two contiguous tensors of the counted bytes on the same device, alternating
with the conversion, ``--repeats`` times. ``WHAT_vs_copy`` = best copy time / best conversion time (best of the
repeats on both sides: on a shared machine the fastest run is the least disturbed one);
``WHAT_vs_copy_spread`` = [lowest, highest] of the per-repeat ratios (copy time / conversion time of one
alternation), which shows how much the machine moved the figure. For ``identity`` a second reference is reported,
``identity_vs_blockcopy``: the same shuffled blocks copied one by one (CPU: one libc ``memmove`` per K or V block,
in token order; CUDA: one ``copy_`` per block), which shows how much of the gap to the flat copy is the scattered
access itself. GB/s = 1e9 bytes / s. On CPU with one torch thread (the default) the seconds are this process's CPU
time (``time.process_time``), so other jobs on a shared machine do not count as our time; otherwise wall-clock time.
Prints the figures last as one JSON line (higher is better; targets: every ``*_vs_copy`` >= 0.5, identity >= 0.8).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import random
import time

import torch

from dlmix.kv import KVLayout, ModelIdentity, allocate, convert, convert_from_ranks, pack, unpack, wire_chunks

MODEL = ModelIdentity("LlamaForCausalLM", num_layers=32, num_kv_heads=8, head_size=128, attention="gqa")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _time(fn, device: torch.device, cpu_clock: bool) -> float:
    """Seconds for ``fn()``: this process's CPU time when ``cpu_clock`` (CPU device, one thread: a shared box
    descheduling us then does not count), else wall-clock time after a device sync."""
    _sync(device)
    clock = time.process_time if cpu_clock else time.perf_counter
    t0 = clock()
    fn()
    _sync(device)
    return clock() - t0


def _pool(layout: KVLayout, n_tokens: int, device: torch.device, rng: random.Random, spare: float = 0.25):
    """Caches with ~25 % spare blocks and a shuffled block table for ``n_tokens``."""
    need = -(-n_tokens // layout.block_size)
    total = need + max(1, int(need * spare))
    caches = allocate(layout, total, device=device, fill=None)
    for t in caches:
        for x in (t if isinstance(t, tuple) else (t,)):
            x.view(torch.uint8).random_(0, 60)  # finite values in every dtype
    ids = list(range(total))
    rng.shuffle(ids)
    return caches, ids[:need]


#: the case names ``--cases`` takes, in the order they run
CASES = ("identity", "rechunk", "pack", "unpack", "cast", "fp8", "nhd_to_hnd", "hnd_to_nhd", "to_vllm_cpu",
         "vllm_cpu_rechunk", "reshard")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="256 MiB, 7 repeats")
    ap.add_argument("--mib", type=int, default=None, help="destination KV MiB per case (default 512, quick 256)")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads for copy and conversion alike (default 1: on a shared 2-core box a "
                         "multi-threaded run mostly measures the other jobs)")
    ap.add_argument("--cases", default="",
                    help="comma-separated case names to run (default: all; the JSON line then holds only those)")
    a = ap.parse_args()
    only = {c.strip() for c in a.cases.split(",") if c.strip()}
    if only - set(CASES):
        ap.error(f"--cases: unknown case(s) {', '.join(sorted(only - set(CASES)))}; known: {', '.join(CASES)}")
    for flag, v in (("--mib", a.mib), ("--repeats", a.repeats)):
        if v is not None and v < 1:
            ap.error(f"{flag} must be >= 1, got {v}")
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error(f"--device {a.device}: no CUDA device here (torch.cuda.is_available() is False); use --device cpu")
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    mib = a.mib or (256 if a.quick else 512)
    repeats = a.repeats or (7 if a.quick else 9)
    device = torch.device(a.device)
    rng = random.Random(0)

    def lay(bs: int, dtype: str = "bf16", tp: int = 1, rank: int = 0, arr: str = "vllm_flash_nhd") -> KVLayout:
        return KVLayout(MODEL, bs, dtype, arr, tp, rank)

    cpu_clock = device.type == "cpu" and torch.get_num_threads() == 1
    results: dict[str, object] = {"device": str(device), "torch_threads": torch.get_num_threads(),
                                  "clock": "process_cpu_time" if cpu_clock else "wall",
                                  "kv_mib": mib, "repeats": repeats, "model": "llama3-8b-kv(32x8x128)"}

    def measure(name: str, nbytes: int, run_conv, blockcopy=None) -> None:
        assert name in CASES, name
        if only and name not in only:
            return
        a_src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
        a_dst = torch.empty_like(a_src)
        run_conv()  # warm-up
        a_dst.copy_(a_src)
        t_copy, t_conv, t_block = [], [], []
        for _ in range(repeats):
            t_copy.append(_time(lambda: a_dst.copy_(a_src), device, cpu_clock))
            t_conv.append(_time(run_conv, device, cpu_clock))
            if blockcopy is not None:
                t_block.append(_time(blockcopy, device, cpu_clock))
        del a_src, a_dst
        copy_gbps = nbytes / min(t_copy) / 1e9
        conv_gbps = nbytes / min(t_conv) / 1e9
        pair = [c / v for c, v in zip(t_copy, t_conv)]
        results[f"{name}_GBps"] = round(conv_gbps, 3)
        results[f"{name}_copy_GBps"] = round(copy_gbps, 3)
        results[f"{name}_vs_copy"] = round(conv_gbps / copy_gbps, 3)
        results[f"{name}_vs_copy_spread"] = [round(min(pair), 3), round(max(pair), 3)]
        extra = ""
        if t_block:
            block_gbps = nbytes / min(t_block) / 1e9
            results[f"{name}_blockcopy_GBps"] = round(block_gbps, 3)
            results[f"{name}_vs_blockcopy"] = round(conv_gbps / block_gbps, 3)
            extra = f"  blockcopy {block_gbps:7.2f} GB/s  ratio {conv_gbps / block_gbps:5.2f}"
        print(f"{name:16s} {nbytes / 2**20:6.0f} MiB  convert {conv_gbps:7.2f} GB/s  copy {copy_gbps:7.2f} GB/s  "
              f"ratio {conv_gbps / copy_gbps:5.2f} (per-run {min(pair):.2f}-{max(pair):.2f}){extra}", flush=True)

    bf16_tok = lay(32).kv_bytes_per_token()
    n = mib * 2**20 // bf16_tok

    # identity
    s, d = lay(32), lay(32)
    sc, sb = _pool(s, n, device, rng)
    dc, db = _pool(d, n, device, rng)
    def blockcopy() -> None:  # the same shuffled blocks, one copy per block, K and V, in token order
        pairs = list(zip(sb, db))
        for x, y in zip(sc, dc):
            for plane in range(2):
                xs, ys = x[plane], y[plane]
                if device.type == "cpu":
                    w = xs[0].numel() * xs.element_size()
                    xp, yp = xs.data_ptr(), ys.data_ptr()
                    for i, j in pairs:
                        ctypes.memmove(yp + j * w, xp + i * w, w)
                else:
                    for i, j in pairs:
                        ys[j].copy_(xs[i])

    measure("identity", d.wire_bytes(n), lambda: convert(s, sc, sb, d, dc, db, n), blockcopy)
    del dc

    # re-chunk 32 -> 128
    d = lay(128)
    dc, db = _pool(d, n, device, rng)
    measure("rechunk", d.wire_bytes(n), lambda: convert(s, sc, sb, d, dc, db, n))

    # wire path for the same pair, 64 MiB staging buffer: pack (source blocks -> wire) and unpack (wire ->
    # destination blocks) each move every byte once, so each is compared with one plain copy
    staging = torch.empty(64 << 20, dtype=torch.uint8, device=device)
    chunks = wire_chunks(d, 0, n, staging.numel())
    wire = torch.empty(d.wire_bytes(n), dtype=torch.uint8, device=device)
    offs = [d.wire_bytes(x) for x, _ in chunks]

    def packed() -> None:
        for (x, y), o in zip(chunks, offs):
            pack(s, sc, sb, d, x, y, out=wire[o:])

    def unpacked() -> None:
        for (x, y), o in zip(chunks, offs):
            unpack(d, dc, db, wire[o:o + d.wire_bytes(y - x)], x, y)

    measure("pack", d.wire_bytes(n), packed)
    measure("unpack", d.wire_bytes(n), unpacked)
    del dc, staging, wire

    # cast bf16 -> fp32 (destination bytes counted)
    d = lay(32, "fp32")
    dc, db = _pool(d, n, device, rng)
    measure("cast", d.wire_bytes(n), lambda: convert(s, sc, sb, d, dc, db, n))
    del dc

    # fp8 quantization bf16 -> fp8_e4m3 with per-tensor scales (source bytes counted: the bf16 side)
    d = KVLayout(MODEL, 32, "fp8_e4m3", "vllm_flash_nhd", k_scale=0.5, v_scale=0.25)
    dc, db = _pool(d, n, device, rng)
    measure("fp8", s.wire_bytes(n), lambda: convert(s, sc, sb, d, dc, db, n))
    del dc

    # arrangement changes at equal block size and dtype: NHD -> HND, HND -> NHD, NHD -> vLLM CPU (K transposed)
    d = lay(32, arr="vllm_flash_hnd")
    dc, db = _pool(d, n, device, rng)
    measure("nhd_to_hnd", d.wire_bytes(n), lambda: convert(s, sc, sb, d, dc, db, n))
    s2, sc2, sb2 = d, dc, db
    d = lay(32)
    dc, db = _pool(d, n, device, rng)
    measure("hnd_to_nhd", d.wire_bytes(n), lambda: convert(s2, sc2, sb2, d, dc, db, n))
    del dc, sc2
    d = lay(32, arr="vllm_cpu")
    dc, db = _pool(d, n, device, rng)
    measure("to_vllm_cpu", d.wire_bytes(n), lambda: convert(s, sc, sb, d, dc, db, n))
    # vLLM CPU -> vLLM CPU with a block size change (the decode side of a vLLM CPU PD pair)
    d2 = lay(64, arr="vllm_cpu")
    dc2, db2 = _pool(d2, n, device, rng)
    measure("vllm_cpu_rechunk", d2.wire_bytes(n), lambda: convert(d, dc, db, d2, dc2, db2, n))
    del dc, dc2, sc

    # TP re-shard 2 -> 1
    srcs = []
    for r in range(2):
        sl = lay(32, tp=2, rank=r)
        c, b = _pool(sl, n, device, rng)
        srcs.append((sl, c, b))
    d = lay(32)
    dc, db = _pool(d, n, device, rng)
    measure("reshard", d.wire_bytes(n), lambda: convert_from_ranks(srcs, d, dc, db, n))

    results["tokens"] = n
    print(json.dumps(results))


if __name__ == "__main__":
    main()
