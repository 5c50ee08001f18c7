"""Serve the real SmolLM2 with vLLM CPU over the OpenAI API; the greedy chat answer must equal transformers'.

Both run fp32 (the checkpoint is bf16): the dtype is not what this checks, and bf16 matmuls are tens of times slower on
x86 CPUs without AVX-512 BF16; the bf16 serving path is covered by tests/test_vllm_pd.py's bf16 -> fp32 case."""
from __future__ import annotations

import httpx
import pytest

pytest.importorskip("vllm")

from dlmix.engine_process import EngineProcess, VLLMServerSpec, free_port  # noqa: E402

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France?"
MAX_TOKENS = 12


def _hf_greedy(model_dir: str) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    enc = tok.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=MAX_TOKENS, do_sample=False)
    ids = out[0, enc["input_ids"].shape[1]:].tolist()
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    return ids[: ids.index(eos)] if eos in ids else ids


def test_vllm_cpu_serves_smollm2_chat_greedy(smollm2_dir, tmp_path):
    expected_ids = _hf_greedy(str(smollm2_dir))
    spec = VLLMServerSpec(model=str(smollm2_dir), port=free_port(), dtype="float32", served_model_name="smollm2",
                          max_model_len=1024)
    with EngineProcess(spec, name="vllm-single", log_dir=tmp_path) as server:
        body = {"model": "smollm2", "messages": [{"role": "user", "content": QUESTION}],
                "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True}
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        got_ids = choice.get("token_ids")
        assert got_ids is not None, choice
        eos = 2
        got_ids = [t for t in got_ids if t != eos]
        assert got_ids == expected_ids, (choice["message"]["content"], got_ids, expected_ids)
        assert "Paris" in choice["message"]["content"]
