"""dlmix.bench.stats: metric definitions of `vllm bench serve` checked on given numbers."""
from __future__ import annotations

import numpy as np
import pytest

from dlmix.bench.stats import RequestResult, parse_goodput, summarize


def _r(ttft, itl, lat, out, inp=10, ok=True):
    return RequestResult(success=ok, input_tokens=inp, output_tokens=out, ttft=ttft, itl=list(itl), latency=lat)


def test_summary_percentiles_tpot_itl_and_throughput():
    rs = [_r(0.1, [0.01, 0.03], 0.14, 3), _r(0.2, [0.02], 0.22, 2), _r(0.3, [], 0.3, 1),
          _r(0.0, [], 0.05, 0, ok=False)]
    m = summarize(rs, duration_s=2.0, percentiles=(50, 90, 99))
    assert m["completed"] == 3 and m["failed"] == 1
    assert m["total_input_tokens"] == 30 and m["total_output_tokens"] == 6
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(3.0)
    assert m["total_token_throughput"] == pytest.approx(18.0)
    # TTFT over successful requests only: 100, 200, 300 ms
    assert m["ttft_ms"]["mean"] == pytest.approx(200.0)
    assert m["ttft_ms"]["median"] == pytest.approx(200.0)
    assert m["ttft_ms"]["p90"] == pytest.approx(np.percentile([100, 200, 300], 90))
    assert m["ttft_ms"]["p90"] == pytest.approx(280.0)
    # TPOT = (E2EL - TTFT) / (out - 1): (0.14-0.1)/2 = 20 ms, (0.22-0.2)/1 = 20 ms; the 1-token request has none
    assert m["tpot_ms"]["mean"] == pytest.approx(20.0)
    # ITL pools every gap: 10, 30, 20 ms
    assert m["itl_ms"]["median"] == pytest.approx(20.0)
    assert m["itl_ms"]["max"] == pytest.approx(30.0)
    assert m["e2el_ms"]["p99"] == pytest.approx(np.percentile([140, 220, 300], 99))
    assert m["request_goodput"] is None


def test_goodput_counts_requests_within_every_target():
    rs = [_r(0.1, [0.01], 0.11, 2), _r(0.6, [0.01], 0.61, 2), _r(0.1, [0.2], 0.3, 2)]
    m = summarize(rs, 1.0, parse_goodput(["ttft:500", "tpot:50"]))
    assert m["good_fraction"] == pytest.approx(1 / 3)  # 2nd fails TTFT, 3rd fails TPOT (200 ms)
    assert m["request_goodput"] == pytest.approx(1.0)
    m = summarize(rs, 4.0, parse_goodput(["e2el:700"]))
    assert m["request_goodput"] == pytest.approx(3 / 4.0)


def test_good_fraction_counts_failed_requests_as_not_good():
    # 2 completed requests within the targets, 2 failed (e.g. HTTP 500 or a timeout): half of the requests sent were
    # good, so the level does not meet a 90 % SLO (dlmix sim's good_fraction counts failures the same way)
    rs = [_r(0.1, [0.01], 0.11, 2), _r(0.1, [0.01], 0.11, 2), _r(0.0, [], 0.05, 0, ok=False),
          _r(0.0, [], 600.0, 0, ok=False)]
    m = summarize(rs, 2.0, parse_goodput(["ttft:500", "tpot:50"]))
    assert m["completed"] == 2 and m["failed"] == 2
    assert m["good_fraction"] == pytest.approx(0.5)
    assert m["request_goodput"] == pytest.approx(1.0)  # good completed requests per second, unchanged
    m = summarize([_r(0.0, [], 0.05, 0, ok=False)], 1.0, parse_goodput(["ttft:500"]))
    assert m["good_fraction"] == 0.0 and m["request_goodput"] == 0.0


def test_parse_goodput_forms_and_errors():
    assert parse_goodput(["ttft:500 tpot:50", "e2el:1000"]) == {"ttft": 500.0, "tpot": 50.0, "e2el": 1000.0}
    assert parse_goodput(["TTFT:1,tpot:2"]) == {"ttft": 1.0, "tpot": 2.0}
    with pytest.raises(ValueError, match="unknown metric 'itl'"):
        parse_goodput(["itl:5"])
    with pytest.raises(ValueError, match="KEY:MILLISECONDS"):
        parse_goodput(["ttft500"])
    with pytest.raises(ValueError, match="> 0"):
        parse_goodput(["ttft:-1"])


def test_empty_and_bad_duration():
    m = summarize([], 1.0)
    assert m["completed"] == 0 and m["ttft_ms"]["p99"] == 0.0
    with pytest.raises(ValueError):
        summarize([], 0.0)


def test_parse_goodput_refuses_a_nan_target():
    """``--goodput ttft:nan`` passed the ``<= 0`` check and every request then missed it: the run reported goodput
    0.00 (0 %) without an error."""
    with pytest.raises(ValueError, match=r"^--goodput ttft: target must be > 0 ms, got nan$"):
        parse_goodput(["ttft:nan"])


def test_the_table_shows_no_latency_for_a_level_where_every_request_failed():
    """Found by a new user: a level whose requests all failed (LMDeploy refusing token-id prompts) printed
    ``0.0 / 0.0`` ms for TTFT, TPOT, ITL and E2EL, read as the fastest level; it now prints ``-`` there."""
    import io

    from rich.console import Console

    from dlmix.bench.report import render_table

    failed = summarize([_r(0.0, [], 0.01, 0, ok=False)] * 4, duration_s=0.6)
    ok = summarize([_r(0.1, [0.01], 0.11, 2)], duration_s=1.0)
    data = {"label": "x", "base_url": "http://h", "levels": [
        {"level": {"label": "conc=2"}, "metrics": failed, "prefix": {}},
        {"level": {"label": "conc=4"}, "metrics": ok, "prefix": {}}]}
    out = io.StringIO()
    render_table(data, Console(file=out, width=200), title="t")
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]]
            for line in out.getvalue().splitlines() if line.startswith("│")}
    assert rows["conc=2"][:2] == ["0/4", "0.00"] and rows["conc=2"][3:7] == ["-"] * 4, rows
    assert rows["conc=4"][3] == "100.0 / 100.0", rows
