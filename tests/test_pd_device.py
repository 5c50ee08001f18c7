"""Device memory in the PD pull path (dlmix.pd): a producer cache in device memory behind a host-only transport is
served from a bounded host outbox (pages staged at grant time, named in ``blocks_ready``, freed with the hold), and
a consumer cache in device memory is filled through host staging, each round copied to the device and converted
there. The outbox logic runs here on the CPU (forced on a host cache); the CUDA cases skip without a GPU and run in
``benchmarks/kv_convert_device.py``'s machine check (``pytest tests/test_pd_device.py`` on a GPU host)."""
from __future__ import annotations

import pytest
import torch

import dlmix.pd.endpoint as endpoint_mod
from dlmix.kv import KVLayout, ModelIdentity
from dlmix.kv.ops import allocate, read_kv, torch_dtype
from dlmix.pd.endpoint import KVEndpoint
from dlmix.pd.outbox import HostOutbox, needs_outbox
from dlmix.testing import fill_tokens, hold_and_pull, poll

SECRET = "pd-device-test"
CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


def _layout(bs: int, dtype: str, arrangement: str, **kw) -> KVLayout:
    return KVLayout(model=ModelIdentity("LlamaForCausalLM", 2, 2, 16, "gqa", weights_fingerprint="sha256:dd"),
                    block_size=bs, dtype=dtype, arrangement=arrangement, **kw)


def _to(caches, device: str):
    return [tuple(x.to(device) for x in c) if isinstance(c, tuple) else c.to(device) for c in caches]


def _expected(src: KVLayout, dst: KVLayout, x: torch.Tensor, scale: float) -> torch.Tensor:
    """What ``dst`` holds for a value ``x`` of ``src`` (fp8 destinations store ``x / scale``)."""
    if dst.dtype.startswith("fp8"):
        return (x.float() / scale).to(torch_dtype(dst))
    return x.to(torch_dtype(dst))


def _pull_case(src: KVLayout, dst: KVLayout, pdev: str, ddev: str, *, outbox_bytes: int | None = None,
               staging_pages: int = 2, n: int = 150, start: int = 40):
    """Fill a producer cache on ``pdev``, pull tokens ``[start, n)`` into a consumer cache on ``ddev``; returns
    (result, reference values, consumer caches on the CPU, producer endpoint, consumer endpoint)."""
    sblocks = list(range(11, 11 + -(-n // src.block_size)))[::-1]
    dblocks = [5, 2, 7, 1, 3, 6, 4, 8, 9, 10][:-(-n // dst.block_size)]
    sc, dc = allocate(src, 24), allocate(dst, 12)
    ref = fill_tokens(src, sc, sblocks, n)
    sc, dc = _to(sc, pdev), _to(dc, ddev)
    p = KVEndpoint("tcp", "prod", SECRET, "127.0.0.1", 0, src, sc, 0, registration_wait_s=1.0, io_timeout_s=10.0,
                   outbox_bytes=outbox_bytes or 16 * src.block_bytes())
    d = KVEndpoint("tcp", "cons", SECRET, "127.0.0.1", 0, dst, dc, staging_pages * src.block_bytes(),
                   registration_wait_s=1.0, io_timeout_s=10.0)
    res = hold_and_pull(p, d, src, dst, sblocks, dblocks, n, start)
    return res, ref, _to(dc, "cpu"), dblocks, p, d


def _check_values(src, dst, ref, dc, dblocks, n=150, start=40):
    for t in (0, start - 1):
        k, _ = read_kv(dst, dc, dblocks, t, 0)
        assert torch.count_nonzero(k.float()) == 0  # the consumer's own prefix is untouched
    for t in range(start, n):
        for layer in range(src.model.num_layers):
            k, v = read_kv(dst, dc, dblocks, t, layer)
            rk, rv = ref[(t, layer)]
            assert torch.equal(k, _expected(src, dst, rk, dst.k_scale)), (t, layer)
            assert torch.equal(v, _expected(src, dst, rv, dst.v_scale)), (t, layer)


def _release_and_check_freed(p: KVEndpoint, d: KVEndpoint) -> None:
    d.release(p.descriptor(), "req", consumed=True)
    assert poll(p.take_finished, timeout_s=60) == {"req"} and p.held_count() == 0
    if p.outbox is not None:
        assert p.outbox.free_pages == p.outbox.capacity  # no outbox page stays taken


def test_host_cache_needs_no_outbox():
    lay = _layout(32, "bf16", "vllm_cpu")
    caches = allocate(lay, 4)
    p = KVEndpoint("tcp", "plain", SECRET, "127.0.0.1", 0, lay, caches, 0)
    try:
        assert p.outbox is None and not needs_outbox(p.t, lay, caches)
    finally:
        p.close()


@pytest.mark.parametrize("src, dst", [
    (_layout(64, "bf16", "lmdeploy"), _layout(32, "fp32", "vllm_cpu")),
    (_layout(16, "fp16", "vllm_flash_hnd"), _layout(64, "bf16", "sglang_nhd")),
])
def test_outbox_serves_exact_values_and_frees_its_pages(monkeypatch, src, dst):
    """The outbox path forced on a host cache: the transport's regions are the outbox's pages (not the cache), the
    consumer reads the pages ``blocks_ready`` names, values arrive exactly, and the pages are free afterwards."""
    monkeypatch.setattr(endpoint_mod, "needs_outbox", lambda *a: True)
    res, ref, dc, dblocks, p, d = _pull_case(src, dst, "cpu", "cpu")
    try:
        assert res.error is None, res.error
        assert res.loaded_upto == 150 and res.failed_block_ids == [] and res.rounds >= 2
        held = -(-150 // src.block_size)
        assert p.outbox is not None and p.outbox.capacity == 16
        assert p.outbox.free_pages == 16 - held  # the held blocks' pages, until the consumer says consumed
        # the cache itself was never registered: every KV region the transport serves is an outbox page plane
        regions = p.t.regions()
        host_ptrs = {h.data_ptr() for planes in p.outbox.host for h in planes}
        assert {r.ptr for r in regions.values()} == host_ptrs and len(regions) == len(host_ptrs)
        _check_values(src, dst, ref, dc, dblocks)
        _release_and_check_freed(p, d)
    finally:
        p.close()
        d.close()


def test_full_outbox_refuses_with_reason_and_leaks_nothing(monkeypatch):
    """An outbox of 2 pages cannot stage a 3-block request: the consumer gets the producer's reason, reports every
    block failed (the engine recomputes), and abort frees the hold; no page stays taken."""
    monkeypatch.setattr(endpoint_mod, "needs_outbox", lambda *a: True)
    src, dst = _layout(64, "bf16", "lmdeploy"), _layout(64, "bf16", "lmdeploy")
    res, _ref, _dc, dblocks, p, d = _pull_case(src, dst, "cpu", "cpu", outbox_bytes=2 * src.block_bytes())
    try:
        assert p.outbox.capacity == 2
        assert res.loaded_upto == 40 and res.failed_block_ids == dblocks[:3]
        assert "host outbox has 2 of 2 pages free, the request needs 3" in res.error
        assert p.is_held("req") and p.outbox.free_pages == 2
        d.release(p.descriptor(), "req", consumed=False)
        assert poll(p.take_finished, timeout_s=60) == {"req"} and p.held_count() == 0
        assert p.outbox.free_pages == 2
    finally:
        p.close()
        d.close()


def test_outbox_rejects_a_capacity_below_one_page():
    lay = _layout(32, "bf16", "vllm_cpu")
    with pytest.raises(ValueError, match="cannot hold one page"):
        HostOutbox(lay, allocate(lay, 4), lay.block_bytes() - 1)


@needs_cuda
@pytest.mark.parametrize("pdev, ddev", [("cuda", "cuda"), ("cpu", "cuda"), ("cuda", "cpu")])
@pytest.mark.parametrize("src, dst", [
    (_layout(64, "bf16", "lmdeploy"), _layout(32, "fp32", "vllm_cpu")),
    (_layout(16, "fp16", "vllm_flash_hnd"), _layout(64, "bf16", "sglang_nhd")),
    (_layout(16, "bf16", "vllm_lbnhc"), _layout(32, "fp8_e4m3", "vllm_flash_nhd", k_scale=0.5, v_scale=0.25)),
])
def test_device_caches_over_a_host_only_transport(src, dst, pdev, ddev):
    """Real CUDA caches on either side of the TCP transport: a CUDA producer goes through the host outbox, a CUDA
    consumer through pinned host staging and conversion on the GPU; values equal the reference exactly."""
    res, ref, dc, dblocks, p, d = _pull_case(src, dst, pdev, ddev)
    try:
        assert (p.outbox is not None) == (pdev == "cuda")
        if ddev == "cuda":
            assert d.staging.is_pinned()
        assert res.error is None, res.error
        assert res.loaded_upto == 150 and res.failed_block_ids == [] and res.rounds >= 2
        _check_values(src, dst, ref, dc, dblocks)
        _release_and_check_freed(p, d)
    finally:
        p.close()
        d.close()
