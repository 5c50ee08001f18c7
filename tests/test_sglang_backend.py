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


@pytest.mark.skipif(PY is None, reason="no SGLang venv (run scripts/setup_sglang.sh, or set DLMIX_SGLANG_VENV)")
@pytest.mark.parametrize("aids", ["1", None])
def test_cpu_aids_compute_slow_16bit_linears_in_fp32_only_when_asked(aids):
    """Loaded through SGLang's own ``load_plugins``: with ``DLMIX_SGLANG_CPU_AIDS=1`` an unquantized linear of 16 rows
    or more in a dtype this CPU has no native kernel for goes through :func:`dlmix.testing.cpu_gemm.linear_fp32` (fp32,
    rounded once) and fewer rows keep SGLang's path; without the variable no product goes there."""
    code = """
import torch, torch.nn.functional as F
from sglang.srt.plugins import load_plugins
import dlmix.testing.cpu_gemm as cg
from sglang.srt.layers.quantization import unquant
load_plugins()
seen = []
real = cg.linear_fp32
cg.linear_fp32 = lambda x, *a, **k: seen.append(tuple(x.shape)) or real(x, *a, **k)
cg.slow_gemm_dtypes = lambda: frozenset({torch.bfloat16})
class Layer: pass
layer = Layer()
layer.weight = torch.randn(48, 64).bfloat16()
m = unquant.UnquantizedLinearMethod()
x = torch.randn(20, 64).bfloat16()
y = m.apply(layer, x)
assert torch.equal(y, F.linear(x.float(), layer.weight.float()).bfloat16())
m.apply(layer, torch.randn(3, 64).bfloat16())
print("fp32 products:", seen)
"""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DLMIX_SGLANG_CPU_AIDS")}
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    if aids:
        env["DLMIX_SGLANG_CPU_AIDS"] = aids
    out = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    last = out.stdout.strip().splitlines()[-1]
    assert last == ("fp32 products: [(20, 64)]" if aids else "fp32 products: []"), out.stdout


def _inproc_rows(name: str) -> list[dict]:
    """Run the in-process script ``tests/NAME`` with the SGLang venv's python; its JSON lines (it must exit 0)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update({"SGLANG_USE_CPU_ENGINE": "1", "SGLANG_HOST_IP": "127.0.0.1"})
    out = subprocess.run([PY, str(Path(__file__).with_name(name))], capture_output=True, text=True, timeout=600,
                         env=env)
    rows = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
    assert out.returncode == 0 and rows, out.stdout[-3000:] + out.stderr[-3000:]
    return rows


@pytest.mark.skipif(PY is None, reason="no SGLang venv (run scripts/setup_sglang.sh, or set DLMIX_SGLANG_VENV)")
def test_a_decode_aborted_during_a_pull_round_keeps_its_pages_until_the_round_ends():
    """``tests/sglang_abort_inproc.py``: the receiver of a decode aborted while a pull round runs polls Transferring
    until the round has ended (SGLang frees a Failed room's pages at once), so none of the 272 token slots that go to
    another request afterwards is overwritten by the aborted room's KV, and no failure record stays behind. Before,
    it polled Failed at once, and 256 slots of the reused pages were overwritten."""
    rows = _inproc_rows("sglang_abort_inproc.py")
    assert rows[0] == {"case": "abort-during-pull", "failed_while_pulling": False, "overwritten_slots": 0,
                       "failure_record_left": False, "status_left": False}, rows[0]


@pytest.mark.skipif(PY is None, reason="no SGLang venv (run scripts/setup_sglang.sh, or set DLMIX_SGLANG_VENV)")
def test_a_prefill_aborted_while_its_decode_reads_leaves_no_failure_record():
    """``tests/sglang_prefill_abort_inproc.py``: the prefill's request is aborted while its decode reads the hold; the
    read finishes (blocks_consumed), the room ends Success and SGLang clears the sender, and the abort's failure
    record goes with it (before, one record per such abort stayed for ever, and a reused room inherited it)."""
    rows = _inproc_rows("sglang_prefill_abort_inproc.py")
    assert rows[0]["prefill_final"] == "Success" and rows[0]["failure_record_left"] is None \
        and rows[0]["status_left"] is False, rows[0]


_OUT_OF_VOCAB_CODE = """
from types import SimpleNamespace
from sglang.srt.plugins import load_plugins
from sglang.srt.managers.tokenizer_manager import TokenizerManager
load_plugins()
stub = SimpleNamespace(model_config=SimpleNamespace(vocab_size=100))
for ids in ([1, 2, 100], [-1], [5, 10 ** 12]):
    try:
        TokenizerManager._validate_one_request(stub, None, ids)
        print("accepted", ids)
    except ValueError as e:
        print("refused:", e)
import dlmix_sglang
assert dlmix_sglang._refuse_out_of_vocab(stub, None, [0, 99]) is None
"""


@pytest.mark.skipif(PY is None, reason="no SGLang venv (run scripts/setup_sglang.sh, or set DLMIX_SGLANG_VENV)")
def test_a_token_id_prompt_outside_the_vocabulary_is_refused_before_the_scheduler():
    """Loaded through SGLang's own ``load_plugins``, whatever the transfer backend: a prompt of token ids with an id
    outside ``[0, vocab_size)`` fails SGLang's per-request check with a ValueError naming the id (SGLang answers 400).
    Before, SGLang 0.5.23 passed it to the embedding lookup, whose IndexError ended the scheduler: one request
    ``{"prompt": [999999999]}`` through the dlmix router killed the prefill server."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    out = subprocess.run([PY, "-c", _OUT_OF_VOCAB_CODE], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith(("accepted", "refused"))]
    assert lines == [
        "refused: prompt token id 100 at position 2 is out of the model's vocabulary; valid range is [0, 100)",
        "refused: prompt token id -1 at position 0 is out of the model's vocabulary; valid range is [0, 100)",
        "refused: prompt token id 1000000000000 at position 1 is out of the model's vocabulary; valid range is "
        "[0, 100)"], out.stdout


@pytest.mark.skipif(PY is None, reason="no SGLang venv (run scripts/setup_sglang.sh, or set DLMIX_SGLANG_VENV)")
def test_a_decode_forgets_a_prefill_that_went_away_and_checks_the_next_one_at_that_address():
    """``tests/sglang_restart_inproc.py``: a decode manager runs SGLang's heartbeat checker (as SGLang's Mooncake,
    NIXL and Mori backends do), and when it declares the prefill's address lost, dlmix's pair-check verdict goes
    with SGLang's cached topology, so a prefill started again there is checked anew. Before, no checker ran: after a
    prefill was killed and started again at the same address, every request over that pair timed out (the decode
    kept sending the rooms to the dead prefill's rank ports) until the decode was restarted, and a prefill once
    refused stayed refused."""
    rows = _inproc_rows("sglang_restart_inproc.py")
    assert rows[0] == {"case": "prefill-restarted", "heartbeat_checker": True, "refused_first": True,
                       "refused_after_restart": None}, rows[0]
