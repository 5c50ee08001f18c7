"""``benchmarks/transport.py --kinds``: a contender name it does not know is an input error naming the known ones
(before, a typo such as ``tpc`` ran no transport at all, exited 0 and printed only null ratios)."""
from __future__ import annotations

import pathlib
import subprocess
import sys

BENCH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "transport.py"


def test_unknown_kind_is_refused_with_the_known_ones():
    r = subprocess.run([sys.executable, str(BENCH), "--quick", "--no-netns", "--kinds", "tcp,tpc"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, (r.returncode, r.stdout[-500:], r.stderr[-500:])
    assert "--kinds: unknown contender(s) tpc; known: tcp, shm, dlslime, nixl, nixl_spin, nixl_sm, mooncake" in r.stderr
    assert r.stdout == ""
