"""Fast checks of the SGLang adapter's engine-free parts (no SGLang needed): settings, the pool description and
tensor views, the CPU stand-ins, the plugin's registration metadata."""
from __future__ import annotations

import subprocess
import sys
import tomllib
import types
from pathlib import Path

import pytest
import torch

from dlmix.pd.engine import check_caches
from dlmix.pd.pair import check_pair
from dlmix_sglang.config import DLMixSGLangConfigError, load_settings
from dlmix_sglang.layout import describe_pool, host_tensor, kv_dtype_name, pool_layers

ROOT = Path(__file__).resolve().parents[1]
STANDINS = ROOT / "plugins" / "sglang" / "standins"


def _kv_args(L=3, H=2, D=8, N=4, pages=10, dtype=torch.float32):
    bufs = [torch.randn(N * pages, H, D).to(dtype) for _ in range(2 * L)]
    el = bufs[0].element_size()
    a = types.SimpleNamespace(kv_data_ptrs=[t.data_ptr() for t in bufs], kv_data_lens=[t.numel() * el for t in bufs],
                              kv_item_lens=[N * H * D * el] * (2 * L), kv_head_num=H, total_kv_head_num=H,
                              page_size=N, num_draft_entries=0, state_types=[])
    return a, bufs


def test_settings_defaults_and_refusals():
    s = load_settings("{}")
    assert (s.transport, s.host, s.port) == ("tcp", "127.0.0.1", None)
    with pytest.raises(DLMixSGLangConfigError, match="trnsport"):
        load_settings('{"trnsport": "tcp"}')
    with pytest.raises(DLMixSGLangConfigError, match="not valid JSON"):
        load_settings("{")
    with pytest.raises(DLMixSGLangConfigError, match="shared_secret"):
        load_settings({"host": "10.0.0.1"})
    with pytest.raises(DLMixSGLangConfigError, match="unknown transport"):
        load_settings({"transport": "carrier-pigeon"})
    # the weights check is turned off only by a JSON false: "no", "off" or 0 is refused, not read as false
    assert load_settings({"verify_weights": False}).verify_weights is False
    for v in ("no", "off", 0):
        with pytest.raises(DLMixSGLangConfigError, match="verify_weights"):
            load_settings({"verify_weights": v})
    assert s.pull_threads == 4 and load_settings({"pull_threads": 1}).pull_threads == 1
    for v in (0, 65, True, 2.5, "4"):  # pulls a decode rank runs at once: a JSON integer 1..64
        with pytest.raises(DLMixSGLangConfigError, match="pull_threads"):
            load_settings({"pull_threads": v})


def test_settings_from_environment(monkeypatch):
    monkeypatch.setenv("DLMIX_SGLANG_CONFIG", '{"hold_timeout_s": 7}')
    assert load_settings().hold_timeout_s == 7


@pytest.mark.parametrize("raw,want", [("torch.float32", "fp32"), ("bfloat16", "bf16"), ("auto", "fp16")])
def test_kv_dtype_names(raw, want):
    assert kv_dtype_name(raw, "float16") == want


def test_kv_dtype_fp8_refused():
    with pytest.raises(ValueError, match="not supported"):
        kv_dtype_name("fp8_e4m3")


def test_pool_views_are_the_engine_buffers():
    a, bufs = _kv_args()
    lay = describe_pool(a, model_path="/nonexistent", kv_dtype="fp32", tp_rank=0, tp_size=1)
    assert (lay.arrangement, lay.block_size, lay.model.num_layers, lay.model.head_size) == ("sglang_nhd", 4, 3, 8)
    layers = pool_layers(a, lay)
    assert check_caches(lay, layers) == 10
    for i, (k, v) in enumerate(layers):
        assert k.data_ptr() == bufs[i].data_ptr() and v.data_ptr() == bufs[3 + i].data_ptr()
        assert torch.equal(k, bufs[i]) and torch.equal(v, bufs[3 + i])
    layers[0][0][5, 1, 2] = 42.0  # a write through the view lands in the engine's buffer
    assert bufs[0][5, 1, 2].item() == 42.0


def test_decode_kv_args_without_head_counts_use_the_config(tmp_path):
    """SGLang's decode sets kv_head_num only after building the manager: heads come from config.json then."""
    import json

    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 4, "num_key_value_heads": 2}))
    a, bufs = _kv_args()
    del a.kv_head_num, a.total_kv_head_num
    lay = describe_pool(a, model_path=str(tmp_path), kv_dtype="fp32", tp_rank=0, tp_size=1)
    assert (lay.model.num_kv_heads, lay.model.head_size, lay.model.attention) == (2, 8, "gqa")
    assert check_caches(lay, pool_layers(a, lay)) == 10


def test_different_page_size_and_dtype_pair_is_compatible():
    a, _ = _kv_args(N=4)
    b, _ = _kv_args(N=16, pages=3, dtype=torch.bfloat16)
    la = describe_pool(a, model_path="/m", kv_dtype="fp32", tp_rank=0, tp_size=1)
    lb = describe_pool(b, model_path="/m", kv_dtype="bf16", tp_rank=0, tp_size=1)
    assert check_pair(la, lb) == []
    c, _ = _kv_args(D=16)
    lc = describe_pool(c, model_path="/m", kv_dtype="fp32", tp_rank=0, tp_size=1)
    assert any("head" in r for r in check_pair(la, lc))


@pytest.mark.parametrize("change,match", [({"num_draft_entries": 2}, "draft"), ({"state_types": ["mamba"]}, "state"),
                                          ({"kv_data_ptrs": [1, 2, 3]}, "MLA")])
def test_unsupported_pools_refused(change, match):
    a, _ = _kv_args()
    vars(a).update(change)
    with pytest.raises(ValueError, match=match):
        describe_pool(a, model_path="/m", kv_dtype="fp32", tp_rank=0, tp_size=1)


def test_host_tensor_size_mismatch():
    t = torch.zeros(8)
    with pytest.raises(ValueError, match="is not"):
        host_tensor(t.data_ptr(), 32, torch.float32, (3,))


def test_sgl_kernel_standin_assign_and_copy():
    sys.path.insert(0, str(STANDINS))
    try:
        import sgl_kernel as k
    finally:
        sys.path.remove(str(STANDINS))
    r2t = torch.zeros(3, 8, dtype=torch.int32)
    k.assign_req_to_token_pool_cpu(torch.tensor([2, 0]), r2t, torch.tensor([1, 0]), torch.tensor([3, 2]),
                                   torch.tensor([10, 11, 20, 21]), 8)
    assert r2t[2, 1:3].tolist() == [10, 11] and r2t[0, 0:2].tolist() == [20, 21]
    buf = torch.arange(12, dtype=torch.float32).view(4, 3)
    k.copy_all_layer_kv_cache_cpu(torch.tensor([buf.data_ptr()]), torch.tensor([12]), torch.tensor([0]),
                                  torch.tensor([3]))
    assert buf[0].tolist() == [9.0, 10.0, 11.0]
    with pytest.raises(NotImplementedError, match="some_gpu_op"):
        k.some_gpu_op()
    sys.modules.pop("sgl_kernel", None)


def test_torchvision_standin_imports_and_refuses_use():
    code = ("import sys; sys.path.insert(0, %r)\n"
            "from torchvision.transforms import InterpolationMode\n"
            "import torchvision.transforms.functional as F\n"
            "from torchvision.io import VideoReader\n"
            "assert InterpolationMode.BICUBIC.value == 'bicubic'\n"
            "try:\n    VideoReader('x')\nexcept RuntimeError as e:\n    print('refused', e)\n") % str(STANDINS)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "refused" in out.stdout


def test_plugin_entry_point_and_package_data():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert cfg["project"]["entry-points"]["sglang.srt.plugins"] == {"dlmix": "dlmix_sglang:register"}
    assert "standins/*.py" in cfg["tool"]["setuptools"]["package-data"]["dlmix_sglang"]


@pytest.mark.parametrize("field, value", [("port", True), ("port", "8000"), ("port", 8000.0), ("staging_bytes", True),
                                          ("staging_bytes", "1048576"), ("num_chips", True)])
def test_settings_refuse_an_integer_field_of_another_json_type(field, value):
    """``{"port": true}`` was read as port 1 (and ``"8000"`` as 8000): a JSON value of another type is refused with
    the field's name, as ``verify_weights`` already refuses ``"no"`` or ``0``; the LMDeploy settings share the rule."""
    from dlmix_lmdeploy.config import DLMixLMDeployConfigError
    from dlmix_lmdeploy.config import load_settings as lmdeploy_settings

    with pytest.raises(DLMixSGLangConfigError, match=f"{field}: Input should be a valid integer"):
        load_settings({field: value})
    with pytest.raises(DLMixLMDeployConfigError, match=f"{field}: Input should be a valid integer"):
        lmdeploy_settings({field: value})
    assert load_settings({"port": 8000, "staging_bytes": 1 << 20, "num_chips": 2}).port == 8000
