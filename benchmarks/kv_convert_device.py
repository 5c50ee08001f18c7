"""Accelerator check of dlmix.kv: KV conversion on a device across every arrangement pair, bit for bit against the
CPU reference, and its bandwidth against a device-to-device copy of the same bytes.

Needs PyTorch and dlmix only (no engine). On a machine with a CUDA GPU::

    python benchmarks/kv_convert_device.py            # every pair; well under 10 minutes on one GPU
    python benchmarks/kv_convert_device.py --quick    # smaller caches, fewer repeats

Without CUDA it runs the same on ``--device cpu`` (a self-test of the script; its figures mean nothing).

Correctness, for every ordered pair (source, destination) of the registered arrangements except ``mla``
(``dlmix.kv.registry.arrangement_names``), four cases, each converted once on the CPU (the reference) and once on
the device from the same random source bytes; the destination bytes must be equal:

* ``same``: bf16 both sides, block size 32;
* ``reblock_cast``: bf16 block 32 -> fp32 block 64;
* ``tp2_fp8``: two bf16 source ranks (TP 2) -> one fp8_e4m3 destination rank (TP 1) with K/V scales 0.5/0.25;
* ``one_buffer_fp8``: bf16 block 32 -> fp8_e5m2 block 64 with scales, the device caches each one buffer.

A case an arrangement does not accept (a layout check refuses it) is listed under ``skipped`` with the reason.

Bandwidth, per pair (case ``same`` at block 32 -> 64): a cache of ``--mib`` MiB of the Llama-3-8B KV shape (32
layers, 8 KV heads, head size 128), shuffled block tables; best of ``--repeats`` of the conversion against best of
``--repeats`` of ``dst.copy_(src)`` over the same number of bytes on the device, measured alternately.
``conversion_vs_device_copy`` = copy time / conversion time (higher is better; 1.0 = as fast as a flat copy).
``row_path_vs_chunked`` = time of the chunked path (``dlmix.kv.plan.ROWS_ON_DEVICE = False``, the path every
device conversion took before the row path) / time of the default path, measured in the same run.
``one_buffer_vs_device_copy``: the same conversion between caches whose layers are views of one buffer each (as
vLLM's workers hold a cache and as the PD consumer's staging region is), which the row path moves in one gather and
one scatter per chunk for every layer plane at once.

Prints a table, then ONE JSON line last: ``conversion_vs_device_copy`` ({"SRC->DST": ratio}),
``conversion_vs_device_copy_min``, ``conversion_gb_s`` (destination bytes written per second, per pair),
``row_path_vs_chunked`` ({"SRC->DST": ratio}) and its minimum, ``mismatches`` (must be empty),
``pairs_checked``, ``skipped``, ``device``.
"""
from __future__ import annotations

import argparse
import json
import random
import time

import torch

from dlmix.kv import KVLayout, ModelIdentity, allocate, convert, convert_from_ranks
from dlmix.kv import plan as kv_plan
from dlmix.kv.registry import arrangement_names

SMALL = ModelIdentity("LlamaForCausalLM", num_layers=2, num_kv_heads=4, head_size=16, attention="gqa")
BIG = ModelIdentity("LlamaForCausalLM", num_layers=32, num_kv_heads=8, head_size=128, attention="gqa")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _planes(caches):
    for t in caches:
        yield from (t if isinstance(t, tuple) else (t,))


def _random(layout: KVLayout, blocks: int, gen: torch.Generator):
    """Caches of ``blocks`` blocks with random finite values (bytes below 60 are finite in every dtype)."""
    caches = allocate(layout, blocks, fill=None)
    for x in _planes(caches):
        v = x.view(torch.uint8)
        v.copy_(torch.randint(0, 60, v.shape, generator=gen, dtype=torch.uint8))
    return caches


def _to(caches, device: torch.device):
    return [tuple(x.to(device) for x in t) if isinstance(t, tuple) else t.to(device) for t in caches]


def _bytes(caches) -> list[torch.Tensor]:
    return [x.detach().cpu().contiguous().view(torch.uint8).reshape(-1) for x in _planes(caches)]


def check_pair(sa: str, da: str, device: torch.device, gen: torch.Generator) -> dict[str, str]:
    """Run the three correctness cases for ``sa -> da``; returns {case: "ok" | "MISMATCH ..." | "skip: reason"}."""
    out: dict[str, str] = {}
    cases = {
        "same": ([KVLayout(SMALL, 32, "bf16", sa)], KVLayout(SMALL, 32, "bf16", da), False),
        "reblock_cast": ([KVLayout(SMALL, 32, "bf16", sa)], KVLayout(SMALL, 64, "fp32", da), False),
        "tp2_fp8": ([KVLayout(SMALL, 32, "bf16", sa, 2, r) for r in range(2)],
                    KVLayout(SMALL, 32, "fp8_e4m3", da, k_scale=0.5, v_scale=0.25), False),
        "one_buffer_fp8": ([KVLayout(SMALL, 32, "bf16", sa)],
                           KVLayout(SMALL, 64, "fp8_e5m2", da, k_scale=0.5, v_scale=0.25), True),
    }
    n, skip = 150, 20
    for case, (srcs, dst, one) in cases.items():
        try:
            sblocks = [9, 2, 4, 7, 1, 0][:-(-n // srcs[0].block_size)]
            dblocks = [5, 0, 3, 1, 2, 6][:-(-n // dst.block_size)]
            src_caches = [_random(s, 10, gen) for s in srcs]
            ref = allocate(dst, 7)
            got = allocate(dst, 7, device=device, one_buffer=one)
            if len(srcs) == 1:
                convert(srcs[0], src_caches[0], sblocks, dst, ref, dblocks, n, skip)
                dev_src = _to(src_caches[0], device)
                if one:  # every layer a view of one buffer on both sides (the fused row path on a device)
                    dev_src = allocate(srcs[0], 10, device=device, one_buffer=True)
                    for x, y in zip(_planes(dev_src), _planes(src_caches[0])):
                        x.copy_(y)
                convert(srcs[0], dev_src, sblocks, dst, got, dblocks, n, skip)
            else:
                convert_from_ranks([(s, c, sblocks) for s, c in zip(srcs, src_caches)], dst, ref, dblocks, n, skip)
                convert_from_ranks([(s, _to(c, device), sblocks) for s, c in zip(srcs, src_caches)], dst, got,
                                   dblocks, n, skip)
            _sync(device)
        except ValueError as e:
            out[case] = f"skip: {e}"
            continue
        bad = [i for i, (a, b) in enumerate(zip(_bytes(ref), _bytes(got))) if not torch.equal(a, b)]
        out[case] = "ok" if not bad else f"MISMATCH in planes {bad[:4]}"
    return out


def bandwidth(sa: str, da: str, device: torch.device, mib: int,
              repeats: int) -> tuple[float, float, float, float] | None:
    """(copy time / conversion time, GB/s written, chunked-path time / conversion time, copy time / conversion
    time between caches that are each one buffer) for ``sa -> da`` (bf16, block 32 -> 64) over ``mib`` MiB of KV;
    None when the pair does not accept the case."""
    try:
        src, dst = KVLayout(BIG, 32, "bf16", sa), KVLayout(BIG, 64, "bf16", da)
    except ValueError:
        return None
    n = (mib << 20) // src.kv_bytes_per_token()
    rng = random.Random(0)
    sb = list(range(-(-n // 32)))
    db = list(range(-(-n // 64)))
    rng.shuffle(sb)
    rng.shuffle(db)
    sc = allocate(src, len(sb), device=device, fill=None)
    dc = allocate(dst, len(db), device=device, fill=None)
    for x in _planes(sc):
        x.view(torch.uint8).random_(0, 60)
    sc1 = allocate(src, len(sb), device=device, fill=None, one_buffer=True)  # as vLLM's workers hold a cache
    dc1 = allocate(dst, len(db), device=device, fill=None, one_buffer=True)
    for x, y in zip(_planes(sc1), _planes(sc)):
        x.copy_(y)
    nbytes = src.kv_bytes_per_token() * n
    a = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    b = torch.empty_like(a)

    def timed(fn) -> float:
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        return time.perf_counter() - t0

    def chunked() -> None:
        kv_plan.ROWS_ON_DEVICE = False
        try:
            convert(src, sc, sb, dst, dc, db, n)
        finally:
            kv_plan.ROWS_ON_DEVICE = True

    convert(src, sc, sb, dst, dc, db, n)  # warm-up (kernels, scratch)
    convert(src, sc1, sb, dst, dc1, db, n)
    chunked()
    b.copy_(a)
    t_conv, t_copy, t_chunked, t_one = [], [], [], []
    for _ in range(repeats):
        t_copy.append(timed(lambda: b.copy_(a)))
        t_conv.append(timed(lambda: convert(src, sc, sb, dst, dc, db, n)))
        t_chunked.append(timed(chunked))
        t_one.append(timed(lambda: convert(src, sc1, sb, dst, dc1, db, n)))
    return (round(min(t_copy) / min(t_conv), 3), round(nbytes / min(t_conv) / 1e9, 1),
            round(min(t_chunked) / min(t_conv), 2), round(min(t_copy) / min(t_one), 3))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="64 MiB caches, 3 repeats (default 512 MiB, 5 repeats)")
    ap.add_argument("--mib", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--no-bandwidth", action="store_true", help="correctness only")
    args = ap.parse_args()
    device = torch.device(args.device)
    mib = args.mib or (64 if args.quick else 512)
    repeats = args.repeats or (3 if args.quick else 5)
    arrs = [a for a in arrangement_names() if a != "mla"]
    gen = torch.Generator().manual_seed(1)
    t0 = time.perf_counter()
    mismatches, skipped, ratios, gbps, vs_chunked, one_buf, checked = [], {}, {}, {}, {}, {}, 0
    print(f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), "
          f"{len(arrs)} arrangements, {mib} MiB per bandwidth run, best of {repeats}", flush=True)
    for sa in arrs:
        for da in arrs:
            res = check_pair(sa, da, device, gen)
            checked += 1
            for case, r in res.items():
                if r.startswith("MISMATCH"):
                    mismatches.append(f"{sa}->{da} {case}: {r}")
                elif r.startswith("skip"):
                    skipped[f"{sa}->{da} {case}"] = r[6:200]
            bw = None if args.no_bandwidth else bandwidth(sa, da, device, mib, repeats)
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the run's caches are gone with bandwidth()'s frame
            if bw is not None:
                ratios[f"{sa}->{da}"], gbps[f"{sa}->{da}"], vs_chunked[f"{sa}->{da}"], one_buf[f"{sa}->{da}"] = bw
            print(f"{sa:>20s} -> {da:<20s} " + " ".join(f"{c}={r[:8]}" for c, r in res.items())
                  + (f"  vs_device_copy {bw[0]:.3f}  {bw[1]:.0f} GB/s  vs_chunked {bw[2]:.2f}  one_buffer "
                     f"{bw[3]:.3f}" if bw else ""),
                  flush=True)
    print(f"{checked} pairs in {time.perf_counter() - t0:.0f} s; {len(mismatches)} mismatches, "
          f"{len(skipped)} cases skipped", flush=True)
    print(json.dumps({"bench": "kv_convert_device", "quick": args.quick, "device": str(device),
                      "conversion_vs_device_copy": ratios,
                      "conversion_vs_device_copy_min": min(ratios.values()) if ratios else None,
                      "conversion_gb_s": gbps, "row_path_vs_chunked": vs_chunked,
                      "row_path_vs_chunked_min": min(vs_chunked.values()) if vs_chunked else None,
                      "one_buffer_vs_device_copy": one_buf,
                      "one_buffer_vs_device_copy_min": min(one_buf.values()) if one_buf else None,
                      "mismatches": mismatches, "pairs_checked": checked, "skipped": skipped,
                      "kv_mib": mib, "repeats": repeats}))


if __name__ == "__main__":
    main()
