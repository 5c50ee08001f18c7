"""``dlmix demo``: the main job of the README, run on the real SmolLM2 model.

Current stage: serve SmolLM2 with one vLLM CPU instance and answer a chat request, streamed to the terminal.
"""
from __future__ import annotations

import json
import sys
import tempfile

import httpx

from dlmix.engine_process import EngineProcess, EngineStartError, VLLMServerSpec, free_port
from dlmix.models import prepare

QUESTIONS = ["What is the capital of France?", "Name three colors."]


def run_single(max_tokens: int = 48) -> int:
    """Start one vLLM CPU server with SmolLM2, stream answers to ``QUESTIONS``; return a process exit code."""
    model = prepare("smollm2")
    spec = VLLMServerSpec(model=str(model), port=free_port(), served_model_name="smollm2", max_model_len=2048)
    log_dir = tempfile.mkdtemp(prefix="dlmix-demo-")
    print(f"[demo] starting vLLM CPU with SmolLM2 on {spec.url} (log in {log_dir})", flush=True)
    try:
        with EngineProcess(spec, name="vllm", log_dir=log_dir) as server:
            for q in QUESTIONS:
                print(f"\nuser> {q}\nassistant> ", end="", flush=True)
                body = {"model": "smollm2", "messages": [{"role": "user", "content": q}],
                        "max_tokens": max_tokens, "temperature": 0, "stream": True}
                text = ""
                with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120) as r:
                    if r.status_code != 200:
                        print(f"\n[demo] HTTP {r.status_code}: {r.read().decode(errors='replace')}")
                        return 1
                    for line in r.iter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        delta = json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                        text += delta
                        print(delta, end="", flush=True)
                print()
                if not text.strip():
                    print("[demo] empty answer")
                    return 1
    except EngineStartError as e:
        print(f"[demo] engine failed to start: {e}", file=sys.stderr)
        return 1
    print("\n[demo] ok")
    return 0
