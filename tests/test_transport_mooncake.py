"""Mooncake adapter: runs the whole transport contract suite for kind ``mooncake`` inside a private network namespace.

Mooncake 0.3.13's listeners bind every interface, so its cases are only run under ``unshare -n`` (root) with the
loopback interface up; the contract module skips them elsewhere. Skips when the package is missing or no netns can be
made here.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _why_not() -> str | None:
    try:
        import dlmix_kv_connectors.mooncake  # noqa: F401
    except ImportError as e:
        return f"mooncake adapter unavailable: {e}"
    if os.environ.get("DLMIX_NETNS") == "1":
        return "already inside the private netns (the contract module runs the cases)"
    if not hasattr(os, "geteuid") or os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("ip"):
        return "needs root, unshare and ip to make a private network namespace"
    return None


@pytest.mark.skipif(_why_not() is not None, reason=str(_why_not()))
def test_mooncake_contract_in_private_netns():
    cmd = (f"ip link set lo up && exec '{sys.executable}' -m pytest -q -p no:cacheprovider "
           f"tests/test_transport_contract.py -k mooncake")
    r = subprocess.run(["unshare", "-n", "sh", "-c", cmd], cwd=ROOT, env=dict(os.environ, DLMIX_NETNS="1"),
                       capture_output=True, text=True, timeout=1500)
    tail = "\n".join((r.stdout + r.stderr).splitlines()[-40:])
    if r.returncode != 0 and "Operation not permitted" in r.stderr and "unshare" in r.stderr:
        pytest.skip(f"unshare -n not permitted here: {r.stderr.strip()[:200]}")
    assert r.returncode == 0, tail
    summary = r.stdout.strip().splitlines()[-1]
    passed = int(re.search(r"(\d+) passed", summary).group(1))
    assert "skipped" not in summary and "failed" not in summary, summary
    import tests.test_transport_contract as contract

    n_cases = sum(1 for name in dir(contract) if name.startswith("test_"))
    assert passed == n_cases, summary
