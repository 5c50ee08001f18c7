"""KV layout descriptor: serialization, TP head assignment, byte sizes, validation, compat check (torch-free)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dlmix.kv import ARRANGEMENTS, KVLayout, ModelIdentity, check_compat, heads_for_rank, wire_bytes

SMOLLM2 = ModelIdentity("LlamaForCausalLM", num_layers=30, num_kv_heads=3, head_size=64, attention="gqa")


def test_import_without_torch() -> None:
    """The descriptor and compat check import and work when torch cannot be imported."""
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import dlmix, dlmix.kv\n"
        "from dlmix.kv import KVLayout, ModelIdentity, check_compat\n"
        "m = ModelIdentity('Llama', 2, 4, 8)\n"
        "a = KVLayout(m, 16, 'bf16', 'lmdeploy')\n"
        "print(check_compat(a, a).ok, KVLayout.from_json(a.to_json()) == a)\n"
        "try:\n    dlmix.kv.convert\nexcept ImportError:\n    print('no-torch')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True", "no-torch"]


def test_heads_for_rank_vllm_rule() -> None:
    # split: 8 heads over TP=2 -> 4 consecutive heads per rank
    assert heads_for_rank(8, 2, 0) == (0, 1, 2, 3)
    assert heads_for_rank(8, 2, 1) == (4, 5, 6, 7)
    # replication: 2 heads over TP=4 -> head rank // 2 (QKVParallelLinear: tp_rank // num_kv_head_replicas)
    assert [heads_for_rank(2, 4, r) for r in range(4)] == [(0,), (0,), (1,), (1,)]
    assert [heads_for_rank(1, 2, r) for r in range(2)] == [(0,), (0,)]
    with pytest.raises(ValueError, match="cannot be split"):
        heads_for_rank(3, 2, 0)
    with pytest.raises(ValueError, match="not a multiple"):
        heads_for_rank(2, 3, 0)
    with pytest.raises(ValueError, match="outside"):
        heads_for_rank(4, 2, 2)


def test_byte_sizes_smollm2() -> None:
    lay = KVLayout(SMOLLM2, block_size=128, dtype="bf16", arrangement="vllm_cpu")
    # 30 layers * 2 (K, V) * 3 heads * 64 * 2 bytes
    assert lay.kv_bytes_per_token() == 23040
    assert lay.block_bytes() == 23040 * 128
    # vLLM CPU page bytes of one layer: num_kv_heads * block_size * 2 * head_size * elem
    # (vllm/v1/attention/backends/cpu_attn.py)
    assert lay.block_bytes(per_layer=True) == 3 * 128 * 2 * 64 * 2
    assert lay.wire_bytes(10) == 230400
    assert lay.wire_bytes(10, heads=[1]) == 76800
    assert wire_bytes(lay, 100, 110) == 230400 and wire_bytes(lay, 5, 5) == 0
    with pytest.raises(ValueError, match="reversed"):
        wire_bytes(lay, 10, 9)
    fp8 = KVLayout(SMOLLM2, 32, "fp8_e4m3", "vllm_flash_nhd", tp_size=3, tp_rank=2, k_scale=0.5, v_scale=2.0)
    assert fp8.heads_for_rank() == (2,)
    assert fp8.kv_bytes_per_token() == 30 * 2 * 1 * 64 * 1
    mla = KVLayout(ModelIdentity("DeepseekV2ForCausalLM", 4, 1, 576, "mla", 512, 64), 64, "bf16", "mla",
                   tp_size=4, tp_rank=3)
    assert mla.heads_for_rank() == (0,)
    assert mla.kv_bytes_per_token() == 4 * 1 * 1 * 576 * 2


def test_layer_shapes_match_engine_sources() -> None:
    m = ModelIdentity("Llama", 2, 4, 8)
    B = 5

    def shape(arr: str, bs: int = 32):
        return KVLayout(m, bs, "fp16", arr, tp_size=2, tp_rank=0).layer_shape(B)

    assert shape("vllm_flash_nhd") == (2, 5, 32, 2, 8)
    assert shape("vllm_flash_hnd") == (2, 5, 2, 32, 8)
    assert shape("vllm_flashinfer_nhd") == (5, 2, 32, 2, 8)
    assert shape("vllm_flashinfer_hnd") == (5, 2, 2, 32, 8)
    assert shape("vllm_cpu") == (5, 2, 32, 16)  # [num_blocks, num_kv_heads, block_size, 2 * head_size]
    assert shape("vllm_lbnhc") == (5, 32, 2, 16)
    assert shape("vllm_lbhnc") == (5, 2, 32, 16)
    assert shape("sglang_nhd", 4) == ((20, 2, 8), (20, 2, 8))
    assert shape("sglang_hnd", 4) == ((5, 2, 4, 8), (5, 2, 4, 8))
    assert shape("lmdeploy") == ((5, 32, 2, 8), (5, 32, 2, 8))


def test_validation_errors() -> None:
    m = ModelIdentity("Llama", 2, 4, 8)
    with pytest.raises(ValueError, match="multiple of 32"):
        KVLayout(m, 16, "bf16", "vllm_cpu")
    with pytest.raises(ValueError, match="unknown arrangement"):
        KVLayout(m, 16, "bf16", "trtllm")
    with pytest.raises(ValueError, match="unknown KV dtype"):
        KVLayout(m, 16, "int4", "lmdeploy")
    with pytest.raises(ValueError, match="only to fp8"):
        KVLayout(m, 16, "bf16", "lmdeploy", k_scale=2.0)
    with pytest.raises(ValueError, match="does not fit"):
        KVLayout(m, 16, "bf16", "mla")
    with pytest.raises(ValueError, match="LMDeploy cannot replicate"):
        KVLayout(m, 16, "bf16", "lmdeploy", tp_size=8)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        ModelIdentity("Deepseek", 2, 1, 500, "mla", 512, 64)
    with pytest.raises(ValueError, match="unknown KVLayout keys"):
        KVLayout.from_dict({**KVLayout(m, 16, "bf16", "lmdeploy").to_dict(), "colour": 1})
    with pytest.raises(ValueError, match="malformed"):
        KVLayout.from_json("{not json")
    with pytest.raises(ValueError, match="incomplete"):
        KVLayout.from_dict({"model": m.__dict__ | {}, "block_size": 16})
    # dtype aliases canonicalize
    assert KVLayout(m, 16, "bfloat16", "lmdeploy").dtype == "bf16"
    assert KVLayout(m, 16, "fp8", "lmdeploy").dtype == "fp8_e4m3"


@st.composite
def layouts(draw: st.DrawFn) -> KVLayout:
    mla = draw(st.booleans())
    if mla:
        r, rope = draw(st.sampled_from([(16, 8), (512, 64)]))
        model = ModelIdentity("DeepseekV3ForCausalLM", draw(st.integers(1, 61)), 1, r + rope, "mla", r, rope,
                              draw(st.none() | st.text(max_size=12)))
        arr = "mla"
    else:
        heads = draw(st.sampled_from([1, 2, 3, 4, 8]))
        model = ModelIdentity(draw(st.sampled_from(["LlamaForCausalLM", "Qwen3ForCausalLM"])),
                              draw(st.integers(1, 80)), heads, draw(st.sampled_from([64, 128])),
                              draw(st.sampled_from(["mha", "gqa"])), 0, 0, draw(st.none() | st.text(max_size=12)))
        arr = draw(st.sampled_from([a for a in ARRANGEMENTS if a != "mla"]))
    bs = draw(st.sampled_from([32, 64, 128])) if arr == "vllm_cpu" else draw(st.integers(1, 256))
    dtype = draw(st.sampled_from(["fp32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2"]))
    ks = draw(st.sampled_from([1.0, 0.25, 3.5])) if dtype.startswith("fp8") else 1.0
    vs = draw(st.sampled_from([1.0, 0.5])) if dtype.startswith("fp8") else 1.0
    if mla:
        tp = draw(st.sampled_from([1, 2, 8]))
    else:
        opts = [t for t in (1, 2, 4, 8) if (model.num_kv_heads % t == 0 or t % model.num_kv_heads == 0)]
        if arr.startswith("lmdeploy"):  # LMDeploy does not replicate KV heads
            opts = [t for t in opts if t <= model.num_kv_heads]
        tp = draw(st.sampled_from(opts))
    return KVLayout(model, bs, dtype, arr, tp, draw(st.integers(0, tp - 1)), ks, vs, engine="test")


@settings(max_examples=200, deadline=None)
@given(layouts())
def test_json_round_trip(lay: KVLayout) -> None:
    text = lay.to_json()
    back = KVLayout.from_json(text)
    assert back == lay
    assert back.to_json() == text
    assert KVLayout.from_dict(json.loads(json.dumps(lay.to_dict()))) == lay
    assert hash(back) == hash(lay)
    assert lay.kv_bytes_per_token() == lay.wire_bytes(1)


def test_compat_reasons() -> None:
    prefill = KVLayout(ModelIdentity("Llama", 30, 4, 64), 32, "bf16", "vllm_flash_nhd")
    decode = KVLayout(ModelIdentity("Llama", 30, 8, 64), 128, "fp32", "vllm_cpu", tp_size=2)
    c = check_compat(prefill, decode)
    assert not c.ok and not bool(c)
    assert c.reasons == ["decode has 8 KV heads, prefill 4: different models"]
    other = KVLayout(ModelIdentity("Qwen3", 28, 4, 128, "mha"), 32, "bf16", "lmdeploy")
    reasons = check_compat(prefill, other).reasons
    assert reasons == [
        "decode runs Qwen3, prefill Llama: different models",
        "decode has 28 layers, prefill 30: different models",
        "decode uses MHA attention, prefill GQA: different models",
        "decode has head size 128, prefill 64: different models",
    ]
    # block size, dtype, arrangement, TP may differ
    same = KVLayout(ModelIdentity("Llama", 30, 4, 64), 128, "fp8_e5m2", "sglang_hnd", tp_size=4, tp_rank=3,
                    k_scale=0.1)
    assert check_compat(prefill, same) == check_compat(same, prefill)
    assert check_compat(prefill, same).ok and check_compat(prefill, same).reasons == []


def test_compat_fingerprint_and_relax() -> None:
    a = KVLayout(ModelIdentity("Llama", 2, 2, 8, weights_fingerprint="sha256:aa"), 16, "bf16", "lmdeploy")
    b = KVLayout(ModelIdentity("Llama", 2, 2, 8, weights_fingerprint="sha256:bb"), 16, "bf16", "lmdeploy")
    unknown = KVLayout(ModelIdentity("Llama", 2, 2, 8), 16, "bf16", "lmdeploy")
    c = check_compat(a, b)
    assert c.reasons == ["decode weights fingerprint 'sha256:bb' differs from prefill 'sha256:aa': "
                         "different weights give different KV"]
    assert check_compat(a, b, relax_fingerprint=True).ok
    assert check_compat(a, unknown).ok  # an unknown fingerprint is not a mismatch
    mla = KVLayout(ModelIdentity("Deepseek", 2, 1, 24, "mla", 16, 8), 16, "bf16", "mla")
    mla2 = KVLayout(ModelIdentity("Deepseek", 2, 1, 24, "mla", 20, 4), 16, "bf16", "mla")
    assert check_compat(mla, mla2).reasons == [
        "decode has MLA kv_lora_rank/rope_dim 20/4, prefill 16/8: different models"]


@pytest.mark.parametrize("path,value,reason", [
    (("block_size",), "16", "block_size must be an integer, got str '16'"),
    (("block_size",), 16.0, "block_size must be an integer, got float"),
    (("block_size",), True, "block_size must be an integer, got bool"),
    (("tp_size",), "1", "tp_size must be an integer"),
    (("tp_rank",), None, "tp_rank must be an integer, got NoneType"),
    (("k_scale",), "0.5", "k_scale must be a finite number, got str"),
    (("v_scale",), float("inf"), "v_scale must be a finite number"),
    (("dtype",), 2, "dtype must be a string, got int"),
    (("arrangement",), ["lmdeploy"], "arrangement must be a string, got list"),
    (("engine",), 3, "engine must be a string"),
    (("model", "num_layers"), "2", "model.num_layers must be an integer, got str '2'"),
    (("model", "head_size"), 8.5, "model.head_size must be an integer"),
    (("model", "architecture"), 1, "model.architecture must be a string"),
    (("model", "weights_fingerprint"), 7, "model.weights_fingerprint must be a string or null"),
])
def test_from_dict_is_strict_about_types(path, value, reason) -> None:
    m = ModelIdentity("Llama", 2, 2, 8, weights_fingerprint="sha256:aa")
    good = KVLayout(m, 16, "fp8_e4m3", "lmdeploy", k_scale=0.5).to_dict()
    bad = json.loads(json.dumps(good))
    (bad["model"] if len(path) == 2 else bad)[path[-1]] = value
    with pytest.raises(ValueError) as e:
        KVLayout.from_dict(bad)
    assert reason in str(e.value)
    # a real JSON body round-trips, an integer scale is a number, a null fingerprint is allowed
    assert KVLayout.from_dict(json.loads(json.dumps(good))) == KVLayout.from_dict(good)
    assert KVLayout.from_dict({**good, "k_scale": 1, "v_scale": 2}).v_scale == 2
    assert KVLayout.from_dict({**good, "model": {**good["model"], "weights_fingerprint": None}}).model == \
        ModelIdentity("Llama", 2, 2, 8)


@pytest.mark.parametrize("field,value", [("num_layers", "2"), ("num_kv_heads", "4"), ("head_size", 8.0),
                                         ("num_layers", True), ("rope_dim", "0")])
def test_model_identity_refuses_non_int_fields(field, value) -> None:
    """New-user review: ``ModelIdentity(num_layers="2")`` was accepted (``int("2")`` passed the range check) and
    left a string in the frozen descriptor; a bool passed as 1. Now a ValueError naming the field and its range."""
    kw = dict(num_layers=2, num_kv_heads=4, head_size=8)
    kw[field] = value
    with pytest.raises(ValueError, match=rf"{field} must be an integer in "):
        ModelIdentity("Llama", **kw)


@pytest.mark.parametrize("field,value", [("block_size", "16"), ("tp_size", "1"), ("tp_rank", False),
                                         ("block_size", 16.0)])
def test_kv_layout_refuses_non_int_fields(field, value) -> None:
    kw = dict(block_size=16, dtype="bf16", arrangement="lmdeploy")
    kw[field] = value
    with pytest.raises(ValueError, match=rf"{field} must be an integer in "):
        KVLayout(ModelIdentity("Llama", 2, 4, 8), **kw)


def test_integral_non_int_values_are_stored_as_int() -> None:
    """An integral value that is not a Python int (e.g. ``numpy.int64`` from a shape) is accepted and stored as int,
    so the JSON form and equality stay those of plain ints."""
    np = pytest.importorskip("numpy")
    m = ModelIdentity("Llama", np.int64(2), np.int32(4), 8)
    lay = KVLayout(m, np.int64(16), "bf16", "lmdeploy")
    assert type(m.num_layers) is int and type(lay.block_size) is int
    assert lay == KVLayout(ModelIdentity("Llama", 2, 4, 8), 16, "bf16", "lmdeploy")
