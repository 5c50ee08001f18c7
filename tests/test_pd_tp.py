"""The pull path between different TP sizes (dlmix.pd consumer/producer over the built-in TCP transport): each
consumer rank reads exactly its KV heads from the producer ranks that hold them (a replicated head once), in any
arrangement pair, and every producer rank's hold is released by the consumer's ranks, none left held.

Values are checked exactly against the full-model cache the producer ranks were cut from; the bytes each consumer
rank receives are checked against what it owns (its heads × tokens' blocks × layers × K/V × element size)."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from dlmix.kv import KVLayout, ModelIdentity
from dlmix.kv.ops import allocate, read_kv, torch_dtype, write_kv
from dlmix.pd.consumer import claim
from dlmix.pd.contract import TransferParams, prompt_digest
from dlmix.pd.endpoint import KVEndpoint
from dlmix.pd.engine import head_subset, page_runs, plane_page_bytes
from dlmix.testing import poll

SECRET = "pd-tp-test"
HEADS = 4


def _layout(bs: int, dtype: str, arrangement: str, tp: int = 1, rank: int = 0, heads: int = HEADS) -> KVLayout:
    return KVLayout(model=ModelIdentity("LlamaForCausalLM", 2, heads, 16, "gqa", weights_fingerprint="sha256:aa"),
                    block_size=bs, dtype=dtype, arrangement=arrangement, tp_size=tp, tp_rank=rank)


def _global_kv(lay: KVLayout, n: int, seed: int = 0) -> dict:
    """K and V ``[all heads, D]`` per (token, layer), exact in ``lay``'s dtype."""
    g = torch.Generator().manual_seed(seed)
    H, D = lay.model.num_kv_heads, lay.model.head_size
    return {(t, layer): (torch.randn(H, D, generator=g).to(torch_dtype(lay)),
                         torch.randn(H, D, generator=g).to(torch_dtype(lay)))
            for t in range(n) for layer in range(lay.model.num_layers)}


def _rank_caches(lay: KVLayout, ref: dict, blocks: list[int], n: int, num_blocks: int = 24):
    caches = allocate(lay, num_blocks)
    heads = list(lay.heads_for_rank())
    for (t, layer), (k, v) in ref.items():
        write_kv(lay, caches, blocks, t, layer, k[heads], v[heads])
    return caches


@pytest.mark.parametrize("ptp, dtp, src_arr, dst_arr", [
    (2, 1, "vllm_cpu", "vllm_cpu"),           # prefill TP 2 -> decode TP 1 (vLLM CPU both sides)
    (1, 2, "vllm_cpu", "vllm_cpu"),           # prefill TP 1 -> decode TP 2: each rank reads half of each page
    (8, 1, "vllm_cpu", "vllm_cpu"),           # prefill TP 8 > 4 KV heads (each head on two ranks) -> TP 1
    (1, 8, "vllm_cpu", "vllm_cpu"),           # decode TP 8 > 4 KV heads: two ranks receive each head
    (4, 2, "vllm_flash_nhd", "lmdeploy"),     # NHD pages (head runs per token) into separate K/V
    (2, 4, "lmdeploy", "vllm_flash_hnd"),
    (1, 2, "vllm_flashinfer_hnd", "sglang_nhd"),
])
def test_pull_between_tp_sizes_is_exact_and_reads_only_owned_heads(ptp, dtp, src_arr, dst_arr):
    n, start = 150, 0
    sbs, dbs = (32, 16) if src_arr == "vllm_cpu" else (16, 32)
    if dst_arr == "vllm_cpu":
        dbs = 64
    src0 = _layout(sbs, "bf16", src_arr, ptp)
    dst0 = _layout(dbs, "fp32", dst_arr, dtp)
    ref = _global_kv(src0, n)
    sblocks = list(range(3, 3 + -(-n // sbs)))[::-1]
    dblocks = list(range(1, 1 + -(-n // dbs)))[::-1]
    digest = prompt_digest(range(n))
    prods = [KVEndpoint("tcp", f"p{r}", SECRET, "127.0.0.1", 0, src0.with_rank(r),
                        _rank_caches(src0.with_rank(r), ref, sblocks, n), 0, registration_wait_s=2.0,
                        io_timeout_s=20.0) for r in range(ptp)]
    conss = []
    try:
        for r in range(dtp):
            lay = dst0.with_rank(r)
            conss.append((lay, allocate(lay, 12), None))
        conss = [(lay, dc, KVEndpoint("tcp", f"d{r}", SECRET, "127.0.0.1", 0, lay, dc, 1 << 16,
                                      registration_wait_s=2.0, io_timeout_s=20.0))
                 for r, (lay, dc, _) in enumerate(conss)]
        for p in prods:
            p.add_hold("req", sblocks, n, digest)
        params = TransferParams.make(engine="reference", instance_id="p0", transports=[p.descriptor() for p in prods],
                                     request_id="req", block_ids=sblocks, num_tokens=n, layout=src0, digest=digest)
        for lay, dc, d in conss:
            c = claim(params.to_dict(), lay, n + 1, start, prompt_token_ids=list(range(n + 1)))
            assert c.refused is None and (c.start, c.end) == (start, n)
            res = d.pull_params(c.params, c.start, c.end, dblocks, digest=digest)
            assert res.error is None, res.error
            assert res.loaded_upto == n and res.failed_block_ids == []
            # bytes received: exactly this rank's heads of every source block read (bf16 = 2 B), K and V, 2 layers
            mine = len(lay.heads_for_rank())
            assert res.bytes_received == len(sblocks) * sbs * mine * 16 * 2 * 2 * 2
            heads = list(lay.heads_for_rank())
            for t in (0, 31, 32, 77, n - 1):
                for layer in range(2):
                    k, v = read_kv(lay, dc, dblocks, t, layer)
                    rk, rv = ref[(t, layer)]
                    assert torch.equal(k, rk[heads].to(torch.float32)) and torch.equal(v, rv[heads].to(torch.float32))
        for lay, dc, d in conss:
            d.release(list(params.transports), "req", consumed=True)
        for p in prods:
            assert poll(p.take_finished, timeout_s=60) == {"req"} and p.held_count() == 0
    finally:
        for p in prods:
            p.close()
        for *_, d in conss:
            if d is not None:
                d.close()


def test_hold_waits_for_every_consumer_rank_and_unread_replicas_are_released():
    """Prefill TP 4 over 2 KV heads (each head on two ranks), decode TP 2: ranks 1 and 3 are never read, yet every
    producer rank's hold ends when both consumer ranks released it, and not before."""
    src0 = _layout(32, "bf16", "vllm_cpu", 4, heads=2)
    dst0 = _layout(32, "bf16", "vllm_cpu", 2, heads=2)
    n = 64
    ref = _global_kv(src0, n)
    prods = [KVEndpoint("tcp", f"q{r}", SECRET, "127.0.0.1", 0, src0.with_rank(r),
                        _rank_caches(src0.with_rank(r), ref, [0, 1], n, 4), 0, registration_wait_s=2.0,
                        io_timeout_s=20.0) for r in range(4)]
    conss = [KVEndpoint("tcp", f"e{r}", SECRET, "127.0.0.1", 0, dst0.with_rank(r), allocate(dst0.with_rank(r), 4),
                        1 << 16, registration_wait_s=2.0, io_timeout_s=20.0) for r in range(2)]
    try:
        for p in prods:
            p.add_hold("req", [0, 1], n)
        remotes = [p.descriptor() for p in prods]
        for d in conss:
            res = d.pull(remotes, "req", [0, 1], 0, n, [2, 3], src_layout=src0)
            assert res.error is None and res.bytes_received == 2 * 32 * 1 * 16 * 2 * 2 * 2
        assert [bool(p.holds["req"].peers) for p in prods] == [True, False, True, False]
        conss[0].release(remotes, "req", consumed=True)
        assert all(p.take_finished() == set() and p.is_held("req") for p in prods)  # one rank of two released
        conss[1].release(remotes, "req", consumed=True)
        for p in prods:
            assert poll(p.take_finished, timeout_s=60) == {"req"} and p.held_count() == 0
    finally:
        for e in prods + conss:
            e.close()


def test_second_rank_gets_its_own_grant_and_a_third_peer_is_refused():
    """Decode TP 2 reading a prefill TP 1 rank: two peers, two grants under different transfer ids; a third peer
    of the same request (more than the stated ranks) is refused, and the holds end after both releases."""
    src = _layout(32, "bf16", "vllm_cpu", 1)
    dst0 = _layout(32, "bf16", "vllm_cpu", 2)
    ref = _global_kv(src, 40)
    p = KVEndpoint("tcp", "s0", SECRET, "127.0.0.1", 0, src, _rank_caches(src, ref, [0, 1], 40, 4), 0,
                   registration_wait_s=2.0, io_timeout_s=20.0)
    ds = [KVEndpoint("tcp", f"t{r}", SECRET, "127.0.0.1", 0, dst0.with_rank(r), allocate(dst0.with_rank(r), 4),
                     1 << 16, registration_wait_s=2.0, io_timeout_s=20.0) for r in range(2)]
    intruder = KVEndpoint("tcp", "t9", SECRET, "127.0.0.1", 0, dst0.with_rank(1), allocate(dst0.with_rank(1), 4),
                          1 << 16, registration_wait_s=2.0, io_timeout_s=20.0)
    try:
        p.add_hold("req", [0, 1], 40)
        for d in ds:
            assert d.pull([p.descriptor()], "req", [0, 1], 0, 40, [2, 3], src_layout=src).error is None
        assert sorted(p.holds["req"].peers.values()) == ["req", "req~1"]
        res = intruder.pull([p.descriptor()], "req", [0, 1], 0, 40, [2, 3], src_layout=src)
        assert "already granted to another consumer" in res.error and res.failed_block_ids == [2, 3]
        for d in ds:
            d.release([p.descriptor()], "req", consumed=True)
        assert poll(p.take_finished, timeout_s=60) == {"req"} and p.held_count() == 0
    finally:
        for e in [p, intruder, *ds]:
            e.close()


def test_page_runs_form_the_subset_layouts_pages():
    """For every arrangement, the head runs of a page, read in order, are a page of the head-subset layout."""
    from dlmix.kv.registry import arrangement_names

    for arr in arrangement_names():
        if arr == "mla":
            continue
        src = _layout(32, "fp16", arr, 1)
        cache = allocate(src, 2)
        ref = _global_kv(src, 64, seed=3)
        for (t, layer), (k, v) in ref.items():
            write_kv(src, cache, [0, 1], t, layer, k, v)
        for heads in [(0, 1), (2, 3), (1,), (3,)]:
            sub = head_subset(src, heads)
            assert tuple(sub.heads_for_rank()) == heads
            runs = page_runs(src, heads)
            assert runs is not None, arr
            from dlmix.pd.engine import layer_planes, plane_count

            sub_cache = allocate(sub, 2)
            for layer in range(2):
                for pl, (splane, dplane) in enumerate(zip(layer_planes(src, cache[layer]),
                                                          layer_planes(sub, sub_cache[layer]))):
                    sb, db = splane.reshape(-1).view(torch.uint8), dplane.reshape(-1).view(torch.uint8)
                    pp, sp = plane_page_bytes(src), plane_page_bytes(sub)
                    assert sum(ln for _, ln in runs[pl]) == sp
                    for blk in range(2):
                        o = blk * sp
                        for off, ln in runs[pl]:
                            db[o:o + ln] = sb[blk * pp + off:blk * pp + off + ln]
                            o += ln
                assert plane_count(src) == len(runs)
            for t in (0, 31, 40, 63):
                for layer in range(2):
                    k, v = read_kv(sub, sub_cache, [0, 1], t, layer)
                    rk, rv = ref[(t, layer)]
                    assert torch.equal(k, rk[list(heads)]) and torch.equal(v, rv[list(heads)]), (arr, heads)
    with pytest.raises(ValueError, match="equal split"):
        head_subset(_layout(32, "fp16", "vllm_cpu", 1), (1, 2))
    assert replace(_layout(32, "fp16", "vllm_cpu", 2, 1), tp_rank=1) == head_subset(_layout(32, "fp16", "vllm_cpu"),
                                                                                     (2, 3))


def test_one_transport_for_a_producer_of_other_tp_is_refused_with_the_reason():
    src = _layout(32, "bf16", "vllm_cpu", 2)
    dst = _layout(32, "bf16", "vllm_cpu", 1)
    ref = _global_kv(src, 40)
    p = KVEndpoint("tcp", "u0", SECRET, "127.0.0.1", 0, src, _rank_caches(src, ref, [0, 1], 40, 4), 0,
                   registration_wait_s=1.0, io_timeout_s=10.0)
    d = KVEndpoint("tcp", "v0", SECRET, "127.0.0.1", 0, dst, allocate(dst, 4), 1 << 16, registration_wait_s=1.0,
                   io_timeout_s=10.0)
    try:
        p.add_hold("req", [0, 1], 40)
        res = d.pull(p.descriptor(), "req", [0, 1], 0, 40, [2, 3], src_layout=src)
        assert "needs every producer rank's transport" in res.error and res.failed_block_ids == [2, 3]
        assert p.holds["req"].peers == {}  # nothing was asked, nothing granted
    finally:
        p.close()
        d.close()


def test_a_failed_read_cancels_the_other_ranks_reads_before_the_pull_returns():
    """A round reads from every producer rank at once. When one read fails (rank 0's engine aborted the request
    between answering and the read: refused), the pull fails with the reason and first cancels the other ranks' reads
    (``cancel()`` returns once none of their bytes can still land), so nothing lands in the staging region after the
    pull gave it up. Before, rank 1's read (slowed here by a stalled link) wrote its bytes there seconds later."""
    import time

    from dlmix.testing.faults import LinkProxy

    n = 64
    src0, dst = _layout(32, "bf16", "vllm_cpu", 2), _layout(64, "fp32", "vllm_cpu", 1)
    ref = _global_kv(src0, n)
    sblocks, digest = [3, 4], prompt_digest(range(n))
    prods = [KVEndpoint("tcp", f"p{r}", SECRET, "127.0.0.1", 0, src0.with_rank(r),
                        _rank_caches(src0.with_rank(r), ref, sblocks, n), 0, registration_wait_s=2.0,
                        io_timeout_s=20.0) for r in range(2)]
    d = KVEndpoint("tcp", "d0", SECRET, "127.0.0.1", 0, dst, allocate(dst, 4), 1 << 20, registration_wait_s=2.0,
                   io_timeout_s=20.0)
    proxy = LinkProxy()
    try:
        proxy.upstream = (prods[1].t.host, prods[1].t.port)
        descs = [prods[0].descriptor(), dict(prods[1].descriptor(), host=proxy.host, port=proxy.port)]
        for p in prods:
            p.add_hold("req", sblocks, n, digest)
        params = TransferParams.make(engine="reference", instance_id="p0", transports=descs, request_id="req",
                                     block_ids=sblocks, num_tokens=n, layout=src0, digest=digest)
        c = claim(params.to_dict(), dst, n + 1, 0, prompt_token_ids=list(range(n + 1)))
        real_read = d.t.read

        def read(peer, segs, transfer_id, timeout_s=None):
            if peer == "p0":
                prods[0].engine_abort("req")  # rank 0's engine drops the request: its read is refused
            else:
                proxy.stall(3.0)  # rank 1's link is slow for a moment: its read is still running
            return real_read(peer, segs, transfer_id=transfer_id, timeout_s=timeout_s)

        d.t.read = read
        res = d.pull_params(c.params, c.start, c.end, [1], digest=digest)
        assert res.error and "GrantError" in res.error and "no active grant" in res.error, res.error
        assert [x for x in list(d.t._xfers.values()) if not x.handle._state] == []
        d.staging.zero_()  # the staging region is free now: the next pull would use it
        time.sleep(4)  # past the stall: a read left running would land now
        assert int(d.staging.count_nonzero()) == 0
    finally:
        proxy.close()
        for e in prods + [d]:
            e.close()


def test_an_endpoint_whose_construction_fails_closes_its_transport():
    """``KVEndpoint`` makes its transport first; when a later step fails (here a staging region too large to
    allocate) the transport is closed before the error propagates: no transport thread stays and the port can be
    bound again at once. Before, the accept and reaper threads ran on and the retry failed with EADDRINUSE."""
    import socket
    import threading

    lay = _layout(32, "bf16", "vllm_cpu")
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with pytest.raises((RuntimeError, MemoryError, ValueError)):
        KVEndpoint("tcp", "ctor", SECRET, "127.0.0.1", port, lay, allocate(lay, 8), 1 << 62)
    assert poll(lambda: not [t for t in threading.enumerate() if t.name.endswith("-ctor")], timeout_s=5), \
        [t.name for t in threading.enumerate()]
    ep = KVEndpoint("tcp", "ctor", SECRET, "127.0.0.1", port, lay, allocate(lay, 8), 1 << 20)
    ep.close()


@pytest.mark.parametrize("ptp, dtp", [(3, 5), (5, 3)])
def test_tp_sizes_whose_head_shares_straddle_ranks_pull_exactly(ptp, dtp):
    """15 KV heads between TP 3 (5 heads per rank) and TP 5 (3 per rank): the heads one producer rank gives one
    consumer rank may be no rank of any equal split (heads 3..4: two heads, and no split of 15 has ranks of two), so
    that share is read as whole pages and the conversion picks the heads out. Every consumer rank gets exactly its
    heads; the pair check accepted these sizes, and every pull used to fail ("not one rank of an equal split")."""
    H, n, bs = 15, 40, 16
    src0 = _layout(bs, "bf16", "vllm_flashinfer_nhd", ptp, heads=H)
    dst0 = _layout(bs, "bf16", "vllm_flashinfer_nhd", dtp, heads=H)
    ref = _global_kv(src0, n)
    sblocks, dblocks = [3, 4, 5], [0, 1, 2]
    prods = [KVEndpoint("tcp", f"p{r}", SECRET, "127.0.0.1", 0, src0.with_rank(r),
                        _rank_caches(src0.with_rank(r), ref, sblocks, n, num_blocks=8), 0, registration_wait_s=2.0,
                        io_timeout_s=20.0) for r in range(ptp)]
    conss = []
    try:
        for p in prods:
            p.add_hold("req", sblocks, n)
        params = TransferParams.make(engine="reference", instance_id="p0", transports=[p.descriptor() for p in prods],
                                     request_id="req", block_ids=sblocks, num_tokens=n, layout=src0)
        for r in range(dtp):
            lay = dst0.with_rank(r)
            dc = allocate(lay, 8)
            d = KVEndpoint("tcp", f"d{r}", SECRET, "127.0.0.1", 0, lay, dc, 1 << 16, registration_wait_s=2.0,
                           io_timeout_s=20.0)
            conss.append(d)
            c = claim(params.to_dict(), lay, n, 0)
            assert c.refused is None
            res = d.pull_params(c.params, c.start, c.end, dblocks)
            assert res.error is None and res.loaded_upto == n, res.error
            heads = list(lay.heads_for_rank())
            for t in range(n):
                for layer in range(2):
                    k, v = read_kv(lay, dc, dblocks, t, layer)
                    rk, rv = ref[(t, layer)]
                    assert torch.equal(k, rk[heads]) and torch.equal(v, rv[heads]), (r, t, layer)
            d.release(list(params.transports), "req", consumed=True)
        for p in prods:
            assert poll(p.take_finished, timeout_s=60) == {"req"} and p.held_count() == 0
    finally:
        for e in prods + conss:
            e.close()
