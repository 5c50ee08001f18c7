"""The one slow launch test: two real vLLM CPU servers (tiny-llama) as prefill/decode behind the dlmix router, wired
by ``dlmix launch`` (DLMixConnector kv_transfer_config, self-registration, shared secret); then a clean stop."""
from __future__ import annotations

import httpx
import pytest

pytest.importorskip("vllm")

from dlmix.engine_process import free_port  # noqa: E402
from dlmix.launch import Deployment, launch  # noqa: E402

pytestmark = pytest.mark.slow


def test_launch_tiny_llama_pd_behind_router(tmp_path, orphans):
    text = f"""
name: tiny-pd
model: tiny-llama
served_model_name: tiny
router: {{port: {free_port()}, policy: round_robin, ready_timeout_s: 300}}
instances:
  - {{name: prefill, role: prefill, port: {free_port()}, cpus: "0", max_model_len: 512,
     kv: {{block_size: 32, dtype: float32}}}}
  - {{name: decode, role: decode, port: {free_port()}, cpus: "1", max_model_len: 512,
     kv: {{block_size: 64, dtype: float32}}}}
"""
    dep = Deployment.from_yaml(text, "tiny-pd.yaml")
    prompt = [(7 * k) % 250 + 3 for k in range(100)]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    with launch(dep, log_dir=tmp_path / "logs") as running:
        orphans.track(pgids=running.pgids())
        admin = httpx.get(running.router_url + "/admin/instances",
                          headers={"Authorization": f"Bearer {running.secret}"}, timeout=10).json()["instances"]
        assert sorted((i["role"], i["block_size"]) for i in admin) == [("decode", 64), ("prefill", 32)]
        # reference: the decode instance alone (local prefill), same fp32 weights, greedy
        ref = httpx.post(running.instances[1].url + "/v1/completions", json=body, timeout=120)
        assert ref.status_code == 200, ref.text
        via = httpx.post(running.url + "/v1/completions", json=body, timeout=120)
        assert via.status_code == 200, via.text
        ref_ids = ref.json()["choices"][0]["token_ids"]
        assert len(ref_ids) == 8
        assert via.json()["choices"][0]["token_ids"] == ref_ids
        assert len(orphans.group_members(running.pgids())) >= 7   # router + 2 x (API server, EngineCore, worker)
    orphans.assert_gone()
