"""The prepared accelerator check (``benchmarks/kv_convert_device.py``) stays runnable: its correctness pass over
every arrangement pair on the CPU (on a GPU machine the same script compares CUDA against the CPU reference)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from dlmix.kv.registry import arrangement_names

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "kv_convert_device.py"


def test_accelerator_check_script_runs_every_pair_on_cpu():
    out = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--no-bandwidth"], capture_output=True,
                         text=True, timeout=900, check=True).stdout
    res = json.loads(out.strip().splitlines()[-1])
    n = len([a for a in arrangement_names() if a != "mla"])
    assert res["pairs_checked"] == n * n and res["mismatches"] == [] and res["skipped"] == {}
    assert res["device"] == "cpu" and res["conversion_vs_device_copy"] == {}


def test_help_states_the_whole_first_sentence():
    """``--help`` printed the docstring's first line only: "... bit for bit against the" (cut mid-sentence)."""
    out = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-500:]
    text = " ".join(out.stdout.split())
    assert ("bit for bit against the CPU reference, and its bandwidth against a device-to-device copy of the same "
            "bytes.") in text
