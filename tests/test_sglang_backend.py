"""The SGLang ``dlmix`` transfer backend driven in one process as SGLang's scheduler drives it (real bootstrap server,
real prefill and decode managers, senders and receivers over fake KV pools; no model, no server): same configuration
(bytes equal), prefill page 4 bf16 -> decode page 16 fp32 (converted), a prefill with other weights refused at
bootstrap with the reason, aux rows copied, a decode abort fails the prefill room with the reason, no hold left. Runs ``tests/sglang_inproc.py`` with the SGLang venv's
python; skipped with the reason when there is none."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from dlmix_sglang.testing import sglang_python

PY = sglang_python()


@pytest.mark.skipif(PY is None, reason="no SGLang venv (run scripts/setup_sglang.sh, or set DLMIX_SGLANG_VENV)")
def test_backend_in_process():
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update({"SGLANG_USE_CPU_ENGINE": "1", "SGLANG_HOST_IP": "127.0.0.1"})
    script = Path(__file__).with_name("sglang_inproc.py")
    out = subprocess.run([PY, str(script)], capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0 and "ALL OK" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
    cases = {r["case"]: r for r in rows}
    assert all(cases[c]["ok"] for c in cases if c.startswith(("same/", "p4-bf16")))
    assert "weights" in cases["other-weights"]["refused"]
    assert cases["decode-abort"]["ok"] and "abort" in cases["decode-abort"]["prefill_reason"].lower()
    assert cases["early-abort"]["ok"]
    assert cases["holds-left"]["counts"] == [0, 0, 0]
