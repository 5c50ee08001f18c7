"""Fast checks of the LMDeploy adapter that need no LMDeploy: the import hook, the enum extension, the settings and
the cache description (on tensors shaped the way LMDeploy 0.18 allocates them)."""
from __future__ import annotations

import enum
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from dlmix.kv import read_kv
from dlmix_lmdeploy import autoload, patches
from dlmix_lmdeploy.config import DLMixLMDeployConfigError, load_settings
from dlmix_lmdeploy.layout import describe_cache, describe_quant_cache


def test_hook_watches_exactly_the_patched_modules():
    assert autoload.WATCHED == set(patches.PATCHES)


def test_extend_enum_is_visible_to_every_lookup():
    class Backend(enum.Enum):
        A = enum.auto()
        B = enum.auto()

    m = patches.extend_enum(Backend, "DLMix")
    assert patches.extend_enum(Backend, "DLMix") is m  # idempotent
    assert Backend["DLMix"] is m and Backend.DLMix is m and Backend(3) is m
    assert [b.name for b in Backend] == ["A", "B", "DLMix"] and "DLMix" in Backend.__members__
    assert m.value == 3 and isinstance(m, Backend)


def test_pth_line_installs_the_finder_and_imports_nothing_else():
    """What site runs at start-up: the hook goes on sys.meta_path, no LMDeploy or torch import follows."""
    from pathlib import Path

    line = (Path(__file__).resolve().parents[1] / "plugins/lmdeploy/dlmix_lmdeploy.pth").read_text().strip()
    code = (f"import sys\n{line}\n"
            "print(any(type(f).__name__ == '_PostImportFinder' for f in sys.meta_path), "
            "'torch' in sys.modules, any(m.startswith('lmdeploy') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "False", "False"]


def test_settings_reject_unknown_keys_and_open_hosts():
    assert load_settings("{}").transport == "tcp"
    with pytest.raises(DLMixLMDeployConfigError, match="hold_timeot_s"):
        load_settings('{"hold_timeot_s": 3}')
    with pytest.raises(DLMixLMDeployConfigError, match="shared_secret"):
        load_settings({"host": "10.0.0.5"})
    with pytest.raises(DLMixLMDeployConfigError, match="not valid JSON"):
        load_settings("{")


def _engine(L=3, B=5, N=16, H=3, D=8, dtype=torch.bfloat16, packed=True, policy=0, pad=0):
    el = torch.empty((), dtype=dtype).element_size()
    size = N * H * D * el
    desc = SimpleNamespace(shape=(N, H, D), dtype=dtype, size=size, aligned_size=size + pad)
    specs = [SimpleNamespace(name="k_cache", desc=desc), SimpleNamespace(name="v_cache", desc=desc)]
    if packed:
        pool = torch.zeros((L, B, 2 * (size + pad)), dtype=torch.uint8)
        views = (pool[:, :, :size].view(dtype).view(L, B, N, H, D),
                 pool[:, :, size + pad:2 * size + pad].view(dtype).view(L, B, N, H, D))
        pools = [SimpleNamespace(tensor=pool)]
    else:
        views = (torch.zeros((L, B, N, H, D), dtype=dtype), torch.zeros((L, B, N, H, D), dtype=dtype))
        pools = [SimpleNamespace(tensor=t) for t in views]
    ce = SimpleNamespace(cache_config=SimpleNamespace(quant_policy=policy, block_size=N, kernel_block_size=N),
                         block_cache_plan=SimpleNamespace(tensor_specs=specs),
                         gpu_allocation=SimpleNamespace(pools=pools, tensor_views=views))
    mc = SimpleNamespace(num_layers=L, num_attention_heads=9, use_standard_kv_cache=True,
                         hf_config=SimpleNamespace(architectures=["LlamaForCausalLM"]))
    return ce, mc, views


@pytest.mark.parametrize("packed", [True, False])
def test_describe_cache_reads_what_lmdeploy_allocated(tmp_path, packed):
    """Both LMDeploy block layouts: the described per-layer caches address exactly the K/V LMDeploy's own views
    hold (token by token, through dlmix.kv's reader)."""
    ce, mc, (k, v) = _engine(packed=packed)
    k.copy_(torch.randn(k.shape).to(k.dtype))
    v.copy_(torch.randn(v.shape).to(v.dtype))
    layout, layers = describe_cache(ce, mc, str(tmp_path), tp_rank=0, tp_size=1)
    assert layout.arrangement == ("lmdeploy_packed" if packed else "lmdeploy")
    assert (layout.block_size, layout.dtype, layout.model.num_kv_heads, layout.model.head_size) == (16, "bf16", 3, 8)
    assert layout.model.attention == "gqa" and layout.model.architecture == "LlamaForCausalLM"
    blocks = [4, 0, 2]
    for t in (0, 15, 16, 40, 47):
        for layer in range(3):
            kk, vv = read_kv(layout, layers, blocks, t, layer)
            b, o = blocks[t // 16], t % 16
            assert torch.equal(kk, k[layer, b, o]) and torch.equal(vv, v[layer, b, o])


@pytest.mark.parametrize("kw, reason", [
    (dict(policy=4), "described by describe_quant_cache"),
    (dict(policy=16), "does not move fp8"),
    (dict(pad=256), "padded"),
    (dict(dtype=torch.float8_e4m3fn), "not moved"),
])
def test_describe_cache_refuses_what_it_does_not_move(tmp_path, kw, reason):
    ce, mc, _ = _engine(**kw)
    with pytest.raises(ValueError, match=reason):
        describe_cache(ce, mc, str(tmp_path), tp_rank=0, tp_size=1)


def _quant_engine(L=2, B=6, N=16, H=3, D=8, sdtype=torch.float16, bits=8):
    """An LMDeploy ``--quant-policy 8`` (or ``4``) packed pool: uint8 K and V ``[N, H, D]`` (``[N, H, D/2]``), then K
    and V scales/zeros ``[N, H, 2]`` in ``sdtype``, each payload padded to 256 bytes (``cache_engine/layout.py``)."""
    el = torch.empty((), dtype=sdtype).element_size()
    P = D if bits == 8 else D // 2
    descs = [SimpleNamespace(shape=(N, H, P), dtype=torch.uint8, size=N * H * P),
             SimpleNamespace(shape=(N, H, P), dtype=torch.uint8, size=N * H * P),
             SimpleNamespace(shape=(N, H, 2), dtype=sdtype, size=N * H * 2 * el),
             SimpleNamespace(shape=(N, H, 2), dtype=sdtype, size=N * H * 2 * el)]
    for d in descs:
        d.aligned_size = (d.size + 255) // 256 * 256
    pool = torch.zeros((L, B, sum(d.aligned_size for d in descs)), dtype=torch.uint8)
    views, off = [], 0
    for d in descs:
        views.append(pool[:, :, off:off + d.size].view(d.dtype).view(L, B, *d.shape))
        off += d.aligned_size
    names = ["k_cache", "v_cache", "quant_0", "quant_1"]
    ce = SimpleNamespace(cache_config=SimpleNamespace(quant_policy=bits, block_size=N, kernel_block_size=N),
                         block_cache_plan=SimpleNamespace(tensor_specs=[SimpleNamespace(name=n, desc=d)
                                                                        for n, d in zip(names, descs)]),
                         gpu_allocation=SimpleNamespace(pools=[SimpleNamespace(tensor=pool)], tensor_views=views))
    mc = SimpleNamespace(num_layers=L, num_attention_heads=9, use_standard_kv_cache=True,
                         hf_config=SimpleNamespace(architectures=["LlamaForCausalLM"]))
    return ce, mc, views


def test_int8_quantization_is_lmdeploys_formula():
    """``q = floor(x / scale + zero + 0.5)`` with ``scale = (max - min) / 255`` and ``zero = -min / scale`` per
    (token, head) vector (LMDeploy ``fill_kv_cache.py``); reading back errs by at most half a step; an evenly spaced
    vector of 256 values is stored exactly; a constant vector reads back exactly."""
    from dlmix.kv.quant import dequantize_asym, quantize_asym

    ramp = (torch.arange(256, dtype=torch.float32) * 0.5 - 10).reshape(1, 256)
    q, sz = quantize_asym(ramp, torch.float32, 8)
    assert torch.equal(q[0].long(), torch.arange(256)) and sz[0].tolist() == [0.5, 20.0]
    assert torch.equal(dequantize_asym(q, sz, 8), ramp)
    x = torch.randn(7, 3, 64, dtype=torch.float16) * 3
    q, sz = quantize_asym(x, torch.float16, 8)
    assert q.dtype == torch.uint8 and sz.shape == (7, 3, 2) and sz.dtype == torch.float16
    s, z = sz[..., :1].float(), sz[..., 1:].float()
    assert torch.equal(q.long(), torch.floor(x.float() / s + z + 0.5).clamp(0, 255).long())
    lo, hi = x.float().amin(-1, keepdim=True), x.float().amax(-1, keepdim=True)
    assert torch.allclose(s, (hi - lo) / 255, rtol=1e-3)
    err = (dequantize_asym(q, sz, 8) - x.float()).abs()
    assert (err <= s * 0.5 + 1e-3).all(), err.max()
    flat = torch.full((2, 64), 1.75)
    q, sz = quantize_asym(flat, torch.float16, 8)
    assert torch.equal(dequantize_asym(q, sz, 8), flat)
    with pytest.raises(ValueError, match="float"):
        quantize_asym(torch.zeros(3, dtype=torch.int32), torch.float16, 8)


def test_int4_quantization_is_lmdeploys_formula_and_packing():
    """``--quant-policy 4``: 15 levels (``scale = (max - min) / 15``), value ``d`` of the first half in the low nibble
    of byte ``d`` and value ``d + D/2`` in its high nibble (LMDeploy ``fill_kv_cache.py`` ``_quant_int4``, read back
    in ``pagedattention.py`` with ``(k >> (d // (D/2) * 4)) & 0x0F``); a 16-step ramp is stored exactly."""
    from dlmix.kv.quant import dequantize_asym, quantize_asym

    ramp = torch.cat([torch.arange(16.0), torch.arange(15.0, -1.0, -1.0)]).reshape(1, 32) * 0.25 - 1
    q, sz = quantize_asym(ramp, torch.float32, 4)
    assert q.shape == (1, 16) and sz[0].tolist() == [0.25, 4.0]
    assert [int(b) & 0x0F for b in q[0]] == list(range(16)) and [int(b) >> 4 for b in q[0]] == list(range(15, -1, -1))
    assert torch.equal(dequantize_asym(q, sz, 4), ramp)
    x = torch.randn(5, 3, 64, dtype=torch.bfloat16)
    q, sz = quantize_asym(x, torch.bfloat16, 4)
    s, z = sz[..., :1].float(), sz[..., 1:].float()
    raw = torch.floor(x.float() / s + z + 0.5).clamp(0, 15).long()
    assert torch.equal(q.long(), raw[..., :32] + 16 * raw[..., 32:])
    assert ((dequantize_asym(q, sz, 4) - x.float()).abs() <= s * 0.5 + 1e-2).all()
    with pytest.raises(ValueError, match="odd"):
        quantize_asym(torch.zeros(2, 7), torch.float16, 4)
    with pytest.raises(ValueError, match="8 or 4 bits"):
        quantize_asym(torch.zeros(2, 8), torch.float16, 2)


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_decode_receives_in_the_model_dtype_and_quantizes_into_its_blocks(tmp_path, bits):
    """A ``--quant-policy 8``/``4`` decode is described as what a transfer into it carries (fp32, ``lmdeploy``
    arrangement, the model's head size); a bf16 packed prefill's blocks converted into its shadow and stored land,
    quantized, in exactly the decode's block ids (uint8 K/V and scales/zeros in LMDeploy's pool), other blocks
    untouched."""
    from dlmix.kv import convert
    from dlmix.kv.quant import quantize_asym

    ce, mc, (kq, vq, ksz, vsz) = _quant_engine(bits=bits)
    layout, cache = describe_quant_cache(ce, mc, str(tmp_path), tp_rank=0, tp_size=1)
    assert (layout.arrangement, layout.dtype, layout.block_size, layout.model.head_size) == ("lmdeploy", "fp32", 16, 8)
    assert "quantized on arrival" in layout.engine
    sce, smc, (k, v) = _engine(L=2, B=8, N=4, packed=True)
    k.copy_(torch.randn(k.shape).to(k.dtype))
    v.copy_(torch.randn(v.shape).to(v.dtype))
    src_layout, src_layers = describe_cache(sce, smc, str(tmp_path), tp_rank=0, tp_size=1)
    tokens, dst_blocks = 20, [4, 1]  # 5 prefill blocks of 4 -> 2 decode blocks of 16
    shadow = cache.shadow(len(dst_blocks))
    convert(src_layout, src_layers, [7, 0, 3, 5, 2], layout, shadow, [0, 1], tokens, 0)
    cache.store(shadow, dst_blocks)
    for layer in range(2):
        for t in (0, 3, 4, 15, 16, 19):
            sb, so = [7, 0, 3, 5, 2][t // 4], t % 4
            b, o = dst_blocks[t // 16], t % 16
            for src, q, sz in ((k, kq, ksz), (v, vq, vsz)):
                want_q, want_sz = quantize_asym(src[layer, sb, so].to(torch.float16), torch.float16, bits)
                assert torch.equal(q[layer, b, o], want_q) and torch.equal(sz[layer, b, o], want_sz)
        for b in (0, 2, 3, 5):
            assert not kq[layer, b].any() and not ksz[layer, b].any()
    ce.cache_config.quant_policy = 16
    with pytest.raises(ValueError, match="not an int8 or int4"):
        describe_quant_cache(ce, mc, str(tmp_path), tp_rank=0, tp_size=1)


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_prefill_holds_dequantized_blocks_a_decode_converts(tmp_path, bits):
    """A ``--quant-policy 8``/``4`` prefill: :meth:`QuantCache.load` writes LMDeploy's read of the held blocks
    (``(q - zero) * scale``, fp32) into the same block ids of its export pool, which its layout describes; a
    bf16/block-4 decode converting from it gets exactly those values rounded to bf16, token by token; blocks not
    held are not touched. A decode of the same quantization (fp16 scales, block 32) that receives them stores
    exactly the prefill's integers, scales and zeros wherever the zero point is below 512, and everywhere values
    within one quantization step (an fp16 zero point of 512 or more can move when re-quantized: seen once in CI on
    unseeded data; the data is seeded now)."""
    from dlmix.kv import convert
    from dlmix.kv.quant import dequantize_asym, quantize_asym

    torch.manual_seed(20 + bits)

    ce, mc, (kq, vq, ksz, vsz) = _quant_engine(bits=bits)
    layout, cache = describe_quant_cache(ce, mc, str(tmp_path), tp_rank=0, tp_size=1, receives=False)
    assert (layout.arrangement, layout.dtype, layout.block_size) == ("lmdeploy", "fp32", 16)
    assert "dequantized while held" in layout.engine
    with torch.inference_mode():
        for t, sz in ((kq, ksz), (vq, vsz)):
            x = torch.randn(*t.shape[:-1], 8) * 3 + torch.randn(*t.shape[:-1], 1) * 5
            q, s = quantize_asym(x, torch.float16, bits)
            t.copy_(q)
            sz.copy_(s)
    pool = cache.export_pool()
    assert len(pool) == 2 and pool[0][0].shape == (6, 16, 3, 8) and pool[0][0].dtype == torch.float32
    for kk, vv in pool:
        kk.fill_(7)
        vv.fill_(7)
    held = [5, 2]
    cache.load(held, pool)
    dce, dmc, (dk, dv) = _engine(L=2, B=10, N=4, packed=True)
    dst_layout, dst_layers = describe_cache(dce, dmc, str(tmp_path), tp_rank=0, tp_size=1)
    dst = [9, 0, 3, 1, 6, 8, 2]  # 25 tokens: 2 prefill blocks of 16 -> 7 decode blocks of 4
    convert(layout, pool, held, dst_layout, dst_layers, dst, 25, 0)
    for layer in range(2):
        for t in (0, 5, 15, 16, 24):
            b, o = held[t // 16], t % 16
            for q, sz, out in ((kq, ksz, dk), (vq, vsz, dv)):
                want = dequantize_asym(q[layer, b, o], sz[layer, b, o], bits)
                assert torch.equal(pool[layer][0 if out is dk else 1][b, o], want)
                assert torch.equal(out[layer, dst[t // 4], t % 4], want.to(torch.bfloat16))
        assert (pool[layer][0][0] == 7).all() and (pool[layer][1][4] == 7).all()
    qce, qmc, (k2, v2, ksz2, vsz2) = _quant_engine(N=32, bits=bits)
    qlayout, qcache = describe_quant_cache(qce, qmc, str(tmp_path), tp_rank=0, tp_size=1)
    shadow = qcache.shadow(1)
    convert(layout, pool, held, qlayout, shadow, [0], 32, 0)
    qcache.store(shadow, [3])
    for layer in range(2):
        for q2, sz2, q1, sz1 in ((k2, ksz2, kq, ksz), (v2, vsz2, vq, vsz)):
            mine_q, mine_sz = q2[layer, 3], sz2[layer, 3]
            their_q = torch.cat([q1[layer, 5], q1[layer, 2]])
            their_sz = torch.cat([sz1[layer, 5], sz1[layer, 2]])
            # exact where the fp16 zero point is below 512 (its rounding moves by at most 0.125 there)
            small = their_sz[..., 1].float().abs() < 512
            assert small.float().mean() > 0.9
            assert torch.equal(mine_sz[small], their_sz[small]) and torch.equal(mine_q[small], their_q[small])
            # everywhere, what the decode reads is within one quantization step of what the prefill read
            step = their_sz[..., :1].float()
            diff = (dequantize_asym(mine_q, mine_sz, bits) - dequantize_asym(their_q, their_sz, bits)).abs()
            assert (diff <= step).all()


def test_router_registration_body_and_load_from_the_engine():
    """What an engine with ``router_url`` sends the router: its role, model, block size, chips, and with DLMix its
    layout and transport; the load from LMDeploy's own scheduler metrics."""
    from dlmix.kv import KVLayout, ModelIdentity
    from dlmix_lmdeploy import router_hook

    with pytest.raises(DLMixLMDeployConfigError, match="router_url needs public_url"):
        load_settings({"router_url": "http://127.0.0.1:8000"})
    settings = load_settings({"router_url": "http://127.0.0.1:8000", "public_url": "http://127.0.0.1:23333",
                              "chip_profile": "cpu-x86", "model_name": "smollm2", "heartbeat_s": 0.5})
    role = enum.Enum("EngineRole", "Hybrid Prefill Decode")
    mb = enum.Enum("MigrationBackend", "DLSlime DLMix")
    eng = SimpleNamespace(cache_config=SimpleNamespace(role=role.Decode, block_size=64, migration_backend=mb.DLSlime),
                          dist_config=SimpleNamespace(attn_tp=1), model_path="/models/smollm2")
    body = router_hook.engine_body(eng, settings)
    assert body == {"url": "http://127.0.0.1:23333", "role": "decode", "engine": "lmdeploy", "model": "smollm2",
                    "chip": "cpu-x86", "num_chips": 1, "block_size": 64, "heartbeat_ttl_s": 3.0}
    lay = KVLayout(model=ModelIdentity("LlamaForCausalLM", 30, 3, 64, "gqa", weights_fingerprint="sha256:aa"),
                   block_size=16, dtype="bf16", arrangement="lmdeploy_packed")
    transport = {"kind": "tcp", "name": "lmdeploy-prefill-1", "host": "127.0.0.1", "port": 5555}
    rank = SimpleNamespace(layout=lay, endpoint=SimpleNamespace(descriptor=lambda: transport))
    eng.cache_config = SimpleNamespace(role=role.Prefill, block_size=16, migration_backend=mb.DLMix)
    body = router_hook.engine_body(eng, load_settings({"router_url": "http://r:1", "public_url": "http://e:2"}), rank)
    assert (body["role"], body["model"], body["block_size"], body["transport"]) == (
        "prefill", "/models/smollm2", 16, transport)
    assert body["kv_layout"] == lay.to_dict() and body["contract_version"] == 1
    bm = SimpleNamespace(num_gpu_blocks=64, get_num_free_gpu_blocks=lambda: 48)
    sched = SimpleNamespace(block_manager=bm, num_waiting=lambda: 1, num_ready=lambda: 1, num_remote_loading=lambda: 1,
                            num_running=lambda: 2)
    assert router_hook.engine_load(sched) == {"waiting": 3, "running": 2, "kv_usage": 0.25}
    assert router_hook.start(eng, rank, load_settings({})) is None  # no router_url: nothing starts


def test_prefix_cache_events_reach_the_routers_keys(tmp_path):
    """Trie nodes as LMDeploy's prefix cache attaches and evicts them (its own block hashes, a root with a negative
    block id) -> the adapter's ZMQ publisher -> the router's LMDeploy decoder: the router's index holds exactly the
    keys it computes for the prompt; an evicted leaf is removed; LoRA and multimodal blocks are not published."""
    import zmq

    from dlmix.router import kv_events
    from dlmix.routing.hashing import BlockHasher
    from dlmix_lmdeploy.kv_events import Publisher

    class Node:  # the fields of lmdeploy.pytorch.paging.block_trie.node.Node the publisher reads
        def __init__(self, block_hash, block_id, token_ids, parent=None, adapter_name=None, extra_identity=()):
            self.block_hash, self.block_id, self.token_ids = block_hash, block_id, token_ids
            self.parent, self.adapter_name, self.extra_identity = parent, adapter_name, extra_identity

    ep = f"ipc://{tmp_path}/events"
    pub = Publisher(ep, block_size=16)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 10000)
    sub.connect(ep)
    hasher = BlockHasher("sha256_cbor", None)
    dec = kv_events.decode_fn("lmdeploy", hasher, 16)
    tokens = [int(t) for t in torch.randint(0, 49000, (64,), generator=torch.Generator().manual_seed(3))]
    root = Node(-7, -1, [])
    got: list = []
    try:
        import time

        time.sleep(0.3)  # ZMQ slow joiner
        parent = root
        nodes = []
        for i in range(4):
            n = Node((2 ** 64 - 1) - i if i % 2 else 1000 + i, 10 + i, tokens[16 * i:16 * (i + 1)], parent)
            pub.stored(n)
            nodes.append(n)
            parent = n
        pub.stored(Node(55, 3, tokens[:16], root, adapter_name="lora-a"))  # not published
        pub.stored(Node(56, 4, tokens[:16], root, extra_identity=(("img", 1),)))
        while len([k for u in got if isinstance(u, kv_events.Stored) for k in u.keys]) < 4:
            got += dec(sub.recv_multipart()[2])
        assert [k for u in got for k in u.keys] == hasher.block_keys(tokens, 16)
        pub.removed(nodes[-1])
        upd = dec(sub.recv_multipart()[2])
        assert upd == [kv_events.Removed(keys=[hasher.block_keys(tokens, 16)[-1]])], upd
    finally:
        sub.close(0)



def test_cpu_aid_linear_computes_slow_16bit_products_in_fp32_and_rounds_once():
    """The LMDeploy CPU aid's linear (:class:`dlmix_lmdeploy.cpu_ops.CpuLinear`, run in the LMDeploy venv) upcasts
    exactly what :mod:`dlmix.testing.cpu_gemm` says: on this CPU's slow 16-bit dtypes, a product of 16 rows or more
    equals the fp32 product rounded once, bit for bit; fewer rows, or a dtype the CPU multiplies natively, take
    LMDeploy's own path."""
    from dlmix_lmdeploy import testing as T

    py = T.lmdeploy_python()
    if py is None:
        pytest.skip("no LMDeploy venv (run scripts/setup_lmdeploy.sh, or set DLMIX_LMDEPLOY_VENV)")
    code = """
import torch, torch.nn.functional as F
from dlmix.testing.cpu_gemm import slow_gemm_dtypes
from dlmix_lmdeploy.cpu_ops import CpuLinear
assert CpuLinear.upcast == slow_gemm_dtypes()
g = torch.Generator().manual_seed(0)
for dt in (torch.bfloat16, torch.float16):
    w, b = torch.randn(48, 64, generator=g).to(dt), torch.randn(48, generator=g).to(dt)
    lin = CpuLinear()
    lin.upcast = frozenset({dt})
    for rows in (16, 40):
        x = torch.randn(rows, 64, generator=g).to(dt)
        y = lin.forward(x, w, b)
        assert y.dtype == dt and torch.equal(y, F.linear(x.float(), w.float(), b.float()).to(dt)), (dt, rows)
    x = torch.randn(15, 64, generator=g).to(dt)
    assert torch.equal(lin.forward(x, w, b), F.linear(x, w, b)), dt
    lin.upcast = frozenset()
    x = torch.randn(40, 64, generator=g).to(dt)
    assert torch.equal(lin.forward(x, w, b), F.linear(x, w, b)), dt
print("ok")
"""
    out = subprocess.run([py, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["ok"], out.stdout


def test_cpu_aid_paged_attention_equals_plain_attention_over_the_whole_sequence():
    """The LMDeploy CPU aid's paged attention (:class:`dlmix_lmdeploy.cpu_ops.CpuPagedAttention`, run in the LMDeploy
    venv), which attends in chunks of ``_Q_ROWS`` query rows, equals one plain attention over each whole sequence
    (fp32, 1e-5): two sequences in one batch, a prefill of 150 tokens and a chunk of 90 tokens after a 70-token
    history (a prefix hit), 9 query heads over 3 KV heads, blocks of 16 in a shuffled block table; and a decode step
    of one token. The step's K/V land in the cache at the sequence's positions."""
    from dlmix_lmdeploy import testing as T

    py = T.lmdeploy_python()
    if py is None:
        pytest.skip("no LMDeploy venv (run scripts/setup_lmdeploy.sh, or set DLMIX_LMDEPLOY_VENV)")
    code = """
import torch, torch.nn.functional as F
from types import SimpleNamespace
from dlmix_lmdeploy.cpu_ops import CpuPagedAttention, _Q_ROWS
assert 70 < 2 * _Q_ROWS < 150
g = torch.Generator().manual_seed(0)
H, KVH, D, BS, NB = 9, 3, 64, 16, 40
attn = CpuPagedAttention(num_heads=H, head_size=D, scale=D ** -0.5, num_kv_heads=KVH, v_head_size=D)
kc, vc = torch.zeros(NB, BS, KVH, D), torch.zeros(NB, BS, KVH, D)
table = torch.randperm(NB, generator=g).view(2, NB // 2)
full_k = [torch.randn(150, KVH, D, generator=g), torch.randn(160, KVH, D, generator=g)]
full_v = [torch.randn(150, KVH, D, generator=g), torch.randn(160, KVH, D, generator=g)]
full_q = [torch.randn(150, H, D, generator=g), torch.randn(160, H, D, generator=g)]
pos = torch.arange(70)  # sequence 1's first 70 tokens are already in its blocks
kc[table[1][pos // BS], pos % BS], vc[table[1][pos // BS], pos % BS] = full_k[1][:70], full_v[1][:70]

def plain(s, lo, hi):
    k, v = full_k[s][:hi].repeat_interleave(3, 1), full_v[s][:hi].repeat_interleave(3, 1)
    mask = torch.arange(hi)[None, :] <= torch.arange(lo, hi)[:, None]
    o = F.scaled_dot_product_attention(full_q[s][lo:hi].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                       attn_mask=mask, scale=D ** -0.5)
    return o.transpose(0, 1)

def step(spans):
    meta = SimpleNamespace(quant_policy=0, block_offsets=table, q_seqlens=torch.tensor([hi - lo for lo, hi in spans]),
                           kv_seqlens=torch.tensor([hi for _, hi in spans]))
    cat = lambda xs: torch.cat([xs[s][lo:hi] for s, (lo, hi) in enumerate(spans)])
    return attn.forward(cat(full_q), cat(full_k), cat(full_v), kc, vc, meta)

out = step([(0, 150), (70, 160)])
want = torch.cat([plain(0, 0, 150), plain(1, 70, 160)])
assert out.shape == want.shape and (out - want).abs().max() < 1e-5, (out - want).abs().max()
pos = torch.arange(160)
assert torch.equal(kc[table[1][pos // BS], pos % BS], full_k[1]) and torch.equal(vc[table[1][pos // BS], pos % BS], full_v[1])
full_q[0] = torch.cat([full_q[0], torch.randn(1, H, D, generator=g)])
full_k[0] = torch.cat([full_k[0], torch.randn(1, KVH, D, generator=g)])
full_v[0] = torch.cat([full_v[0], torch.randn(1, KVH, D, generator=g)])
out = step([(150, 151), (160, 160)])
assert (out - plain(0, 150, 151)).abs().max() < 1e-5, (out - plain(0, 150, 151)).abs().max()
print("ok")
"""
    out = subprocess.run([py, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["ok"], out.stdout


def test_rank_failure_paths_leave_no_session_held_and_never_raise_into_the_engine():
    """The adapter's :class:`dlmix_lmdeploy.backend.Rank` on its failure paths (run in the LMDeploy venv, stand-in
    engine and endpoint, the real core :class:`~dlmix.pd.producer.Producer` where it decides):

    * a hold the core refuses (100 prompt tokens in 2 blocks of 32) leaves the session unheld, so LMDeploy's own
      end/stop of it runs, and a later hold of the same session is made;
    * a migration request naming a negative block id (the body's ``migration_request`` is client input) fails that
      pull with the reason instead of raising into LMDeploy's migration loop (which would stop the decode engine);
    * one ``end_session`` that raises in the prefill's poller does not keep the other released sessions of that
      round held."""
    from dlmix_lmdeploy import testing as T

    py = T.lmdeploy_python()
    if py is None:
        pytest.skip("no LMDeploy venv (run scripts/setup_lmdeploy.sh, or set DLMIX_LMDEPLOY_VENV)")
    code = """
import asyncio
import lmdeploy.pytorch.disagg.backend.backend  # the backend registry first, as in an engine process
from dlmix.kv import KVLayout, ModelIdentity
from dlmix.pd.endpoint import PullResult
from dlmix.pd.producer import Producer
from dlmix_lmdeploy.backend import Peer, Rank

layout = KVLayout(model=ModelIdentity("LlamaForCausalLM", 2, 2, 16, "gqa", weights_fingerprint="sha256:aa"),
                  block_size=32, dtype="bf16", arrangement="vllm_cpu")

class Transport:
    def grant(self, *a, **k): pass
    def revoke(self, tid): return False
    def notify(self, peer, msg): pass

class Endpoint:
    def __init__(self):
        self.producer = Producer(Transport(), layout, num_blocks=16)
        self.pulled = 0
    def add_hold(self, *a, **k): self.producer.add_hold(*a, **k)
    def engine_abort(self, key): self.producer.engine_abort(key)
    def take_finished(self): return self.producer.take_finished()
    def pull(self, *a, **k):
        self.pulled += 1
        return PullResult(loaded_upto=0, error="refused", failed_block_ids=list(a[5]))
    def release(self, *a, **k): pass

class Scheduler:
    def __init__(self, fail_first=False):
        self.fail, self.ended = fail_first, []
    def get_session(self, sid): return object()
    def end_session(self, sid):
        if self.fail:
            self.fail = False
            raise RuntimeError("session in an unexpected state")
        self.ended.append(sid)

async def refused_hold():
    ep, sched = Endpoint(), Scheduler()
    rank = Rank(role="Prefill", layout=layout, endpoint=ep)
    try:
        rank.hold(sched, 7, [1, 2], list(range(100)))
    except ValueError as e:
        assert "need more" in str(e), e
    else:
        raise AssertionError("the core accepted 100 tokens in 2 blocks of 32")
    assert not rank.is_held(7) and not rank.drop(7) and rank.key_of == {} and rank.session_of == {}
    rank.hold(sched, 7, [1, 2, 3, 4], list(range(100)))
    assert rank.is_held(7) and ep.producer.is_held(rank.key_of[7])
    print("refused hold: ok")

def bad_migration():
    ep = Endpoint()
    rank = Rank(role="Decode", layout=None, endpoint=ep)
    rank.peers["http://prefill"] = Peer({"kind": "tcp"}, None)
    res = rank.pull("http://prefill", 0, [-1, 3], [5, 6], [1, 2, 3])
    assert res.loaded_upto == 0 and res.failed_block_ids == [5, 6] and "bad migration request" in res.error, res
    assert ep.pulled == 0
    print("bad migration: ok")

async def poller_keeps_going():
    ep, sched = Endpoint(), Scheduler(fail_first=True)
    rank = Rank(role="Prefill", layout=layout, endpoint=ep)
    for sid, blocks in ((1, [1]), (2, [2]), (3, [3])):
        rank.hold(sched, sid, blocks, list(range(20)))
    for sid in (1, 2, 3):
        assert rank.drop(sid)
    for _ in range(100):
        await asyncio.sleep(0.05)
        if len(sched.ended) == 2:
            break
    assert len(sched.ended) == 2 and not any(rank.is_held(s) for s in (1, 2, 3)), (sched.ended, rank.key_of)
    print("poller: ok")

asyncio.run(refused_hold())
bad_migration()
asyncio.run(poller_keeps_going())
"""
    out = subprocess.run([py, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[:3] == ["refused hold: ok", "bad migration: ok", "poller: ok"], out.stdout


def test_a_decodes_stop_and_end_wait_until_the_pull_writing_their_blocks_is_over():
    """LMDeploy's api_server stops and ends the session of a client that went away at once, and its scheduler then
    frees (or may evict) the session's blocks. A decode pulls a migrating request's KV into those blocks in a thread
    while the engine loop goes on, so without a guard another request could be given the blocks and then have them
    overwritten by the pull. LMDeploy's own handlers (``Engine._on_stop_session``/``_on_end_session``) and migration
    step (``EngineLoop._migration_loop_process_ready``), patched, run here on a stand-in scheduler: a stop and an end
    that come while the pull runs reach the scheduler only once it is over, in order; one that comes when no pull runs
    reaches it at once. Run in the LMDeploy venv."""
    from dlmix_lmdeploy import testing as T

    py = T.lmdeploy_python()
    if py is None:
        pytest.skip("no LMDeploy venv (run scripts/setup_lmdeploy.sh, or set DLMIX_LMDEPLOY_VENV)")
    code = """
import asyncio, contextlib, threading
from types import SimpleNamespace
import lmdeploy.pytorch.disagg.backend.backend  # the backend registry first, as in an engine process
from lmdeploy.pytorch.engine import engine as E, engine_loop as EL
from dlmix.pd.endpoint import PullResult
from dlmix_lmdeploy import backend

calls = []
started, go = threading.Event(), threading.Event()

class Endpoint:
    def pull(self, *a, **k):
        calls.append("pull begins")
        started.set()
        assert go.wait(30)
        calls.append("pull ends")
        return PullResult(loaded_upto=3, bytes_received=10, seconds=0.01)
    def release(self, *a, **k): pass

class Scheduler:
    def get_session(self, sid): return SimpleNamespace(sequences={})
    def stop_session(self, sid): calls.append(f"stop {sid}")
    def end_session(self, sid): calls.append(f"end {sid}")
    def get_block_tables(self, msgs): return [[5]]
    @contextlib.contextmanager
    def seqs_migration_activation(self, ok):
        yield ok

rank = backend.Rank(role="Decode", layout=None, endpoint=Endpoint())
rank.peers["http://prefill"] = backend.Peer({"kind": "tcp"}, None)
backend._rank = rank
engine = SimpleNamespace(scheduler=Scheduler(), _response=lambda resp, t: None,
                         req_manager=SimpleNamespace(reject_request=lambda r: None))
engine.end_session = lambda sid: engine.scheduler.end_session(sid)

async def outputs(ok):
    calls.append("outputs " + ",".join(str(m.session_id) for m in ok))

loop = SimpleNamespace(executor=SimpleNamespace(cache_config=SimpleNamespace(migration_backend=SimpleNamespace(name="DLMix"))),
                       scheduler=engine.scheduler, _migration_loop_get_outputs=outputs,
                       has_runable_event=asyncio.Event())
msg = SimpleNamespace(session_id=11, num_all_ids=3, all_ids=[1, 2, 3],
                      migration_request=SimpleNamespace(is_dummy_prefill=False, remote_engine_id="http://prefill",
                                                        remote_session_id=0, remote_block_ids=[4]))

def req(sid):
    return SimpleNamespace(data={"session_id": sid, "response": False}, resp=None)

async def main():
    task = asyncio.create_task(EL.EngineLoop._migration_loop_process_ready(loop, [msg]))
    while not started.is_set():
        await asyncio.sleep(0.01)
    E.Engine._on_stop_session(engine, [req(11), req(12)])  # the client of 11 went away; 12 is not migrating
    E.Engine._on_end_session(engine, [req(11)])
    calls.append("handlers returned")
    go.set()
    await task

asyncio.run(main())
print(calls)
assert calls == ["pull begins", "stop 12", "handlers returned", "pull ends", "outputs 11", "stop 11", "end 11"], calls
assert rank.pulling == set() and rank.deferred == {}
print("ok")
"""
    out = subprocess.run([py, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:] + out.stdout[-2000:]
    assert out.stdout.split("\n")[-2] == "ok", out.stdout


def test_a_migration_batch_pulls_at_once_so_a_silent_prefill_holds_up_only_its_own_session():
    """The decode's migration of a ready batch (``dlmix_lmdeploy.patches._dlmix_migrate``, run in the LMDeploy venv
    with a stand-in rank and scheduler) runs its pulls ``pull_threads`` at once: session 2's pull completes while
    session 1's prefill has not answered, and a pull that raises fails its own session only. Before, the batch's
    pulls ran one after another, so every session behind a silent prefill waited for its timeouts."""
    from dlmix_lmdeploy import testing as T

    py = T.lmdeploy_python()
    if py is None:
        pytest.skip("no LMDeploy venv (run scripts/setup_lmdeploy.sh, or set DLMIX_LMDEPLOY_VENV)")
    code = """
import asyncio, threading, time
from types import SimpleNamespace as NS
import lmdeploy.pytorch.disagg.backend.backend  # the backend registry first, as in an engine process
from dlmix.pd.consumer import PullResult
from dlmix.pd.settings import EndpointSettings
import dlmix_lmdeploy.backend as backend
from dlmix_lmdeploy.patches import _dlmix_migrate

release, done = threading.Event(), {}

class FakeRank:
    endpoint_settings = EndpointSettings(pull_threads=4)

    def pull(self, engine, session, rblocks, local, ids):
        if engine == "silent":
            release.wait(20)
            done[session] = time.monotonic()
            return PullResult(loaded_upto=0, error="TransferTimeout: silent", failed_block_ids=local)
        if engine == "broken":
            raise RuntimeError("boom")
        done[session] = time.monotonic()
        return PullResult(loaded_upto=len(ids), bytes_received=4096)

backend._rank = FakeRank()
msgs = [NS(session_id=s, num_all_ids=3, all_ids=[1, 2, 3],
           migration_request=NS(is_dummy_prefill=False, remote_engine_id=e, remote_session_id=s + 100,
                                remote_block_ids=[s]))
        for s, e in ((1, "silent"), (2, "live"), (3, "broken"))]
loop = NS(scheduler=NS(get_block_tables=lambda ms: [[10 + ms[0].session_id]]))

async def main():
    task = asyncio.ensure_future(_dlmix_migrate(loop, msgs))
    t0 = time.monotonic()
    while 102 not in done and time.monotonic() - t0 < 10:
        await asyncio.sleep(0.01)
    assert 102 in done and 101 not in done, done  # session 2 done while session 1's prefill is silent
    release.set()
    return await task

failed = asyncio.run(main())
assert set(failed) == {1, 3}, failed
assert failed[1] == "TransferTimeout: silent" and failed[3] == "RuntimeError: boom", failed
print("ok")
"""
    out = subprocess.run([py, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["ok"], out.stdout


def test_pulls_do_not_occupy_the_event_loops_default_executor():
    """The migration batch's pulls run on their own threads, not on the event loop's default executor, which
    LMDeploy's engine itself needs (its multiprocess executor's barrier waits, guided decoding): before, pulls
    waiting on silent prefills occupied it (``min(32, cpus + 4)`` threads) and the engine's own work waited."""
    from dlmix_lmdeploy import testing as T

    py = T.lmdeploy_python()
    if py is None:
        pytest.skip("no LMDeploy venv (run scripts/setup_lmdeploy.sh, or set DLMIX_LMDEPLOY_VENV)")
    code = """
import asyncio, threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace as NS
import lmdeploy.pytorch.disagg.backend.backend
from dlmix.pd.consumer import PullResult
from dlmix.pd.settings import EndpointSettings
import dlmix_lmdeploy.backend as backend
from dlmix_lmdeploy.patches import _dlmix_migrate

release = threading.Event()

class FakeRank:
    endpoint_settings = EndpointSettings(pull_threads=6)

    def pull(self, engine, session, rblocks, local, ids):
        release.wait(20)  # prefills that do not answer
        return PullResult(loaded_upto=0, error="TransferTimeout: silent", failed_block_ids=local)

backend._rank = FakeRank()
msgs = [NS(session_id=s, num_all_ids=3, all_ids=[1, 2, 3],
           migration_request=NS(is_dummy_prefill=False, remote_engine_id="silent", remote_session_id=s + 100,
                                remote_block_ids=[s]))
        for s in range(6)]
loop = NS(scheduler=NS(get_block_tables=lambda ms: [[10 + ms[0].session_id]]))

async def main():
    aloop = asyncio.get_running_loop()
    aloop.set_default_executor(ThreadPoolExecutor(6))  # min(32, cpus + 4) on a 2-core host
    task = asyncio.ensure_future(_dlmix_migrate(loop, msgs))
    await asyncio.sleep(0.5)
    try:  # the engine's own executor work (a barrier wait of its multiprocess executor)
        ok = await asyncio.wait_for(aloop.run_in_executor(None, lambda: "engine"), 3) == "engine"
    except asyncio.TimeoutError:
        ok = False
    release.set()
    await task
    return ok

print("ok" if asyncio.run(main()) else "starved")
"""
    out = subprocess.run([py, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["ok"], out.stdout
