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
from dlmix_lmdeploy.layout import describe_cache


def test_hook_watches_exactly_the_patched_modules():
    assert autoload.WATCHED == set(patches.PATCHES)


def test_extend_enum_is_visible_to_every_lookup():
    import pickle

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
    (dict(policy=8), "quantized KV"),
    (dict(pad=256), "padded"),
    (dict(dtype=torch.float8_e4m3fn), "not moved"),
])
def test_describe_cache_refuses_what_it_does_not_move(tmp_path, kw, reason):
    ce, mc, _ = _engine(**kw)
    with pytest.raises(ValueError, match=reason):
        describe_cache(ce, mc, str(tmp_path), tp_rank=0, tp_size=1)
