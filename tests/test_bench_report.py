"""dlmix.bench.report: results.json is strict JSON with an infinite rate; plots place an unbounded level last."""
from __future__ import annotations

import json
import math

from dlmix.bench.report import load_level_x, write_results
from dlmix.bench.stats import RequestResult


def _strict(text: str):
    """json.loads that refuses the non-standard tokens Infinity, -Infinity and NaN (as JSON.parse does)."""
    def refuse(tok):
        raise ValueError(f"non-standard JSON token {tok}")
    return json.loads(text, parse_constant=refuse)


def test_results_json_is_strict_json_with_an_infinite_rate(tmp_path):
    # --request-rate inf is the default and --burstiness inf a documented value: both must survive as strict JSON
    data = {"label": "run", "settings": {"burstiness": math.inf, "seed": 0},
            "levels": [{"level": {"request_rate": 2.0, "max_concurrency": None, "label": "rate=2"}},
                       {"level": {"request_rate": math.inf, "max_concurrency": None, "label": "rate=inf"}}]}
    raw = [[RequestResult(success=True, output_tokens=2, ttft=0.1, itl=[0.01], latency=0.11)], []]
    d = write_results(tmp_path, "run", data, raw)
    out = _strict((d / "results.json").read_text())
    assert out["settings"]["burstiness"] == "inf"
    assert [lv["level"]["request_rate"] for lv in out["levels"]] == [2.0, "inf"]
    assert load_level_x(out["levels"][1]["level"]) == ("unbounded", math.inf)
    rec = _strict((d / "requests.jsonl").read_text().splitlines()[0])
    assert rec["level"] == 0 and rec["ttft"] == 0.1


def test_unbounded_level_is_plotted_right_of_the_largest_rate():
    from dlmix.bench.report import plot_xs

    # --request-rate 1,2,inf: inf (every request at once) is the heaviest load, not x = 0 on a "level" axis
    lv = lambda r, c=None: {"level": {"request_rate": r, "max_concurrency": c}}
    xname, xs, inf_x = plot_xs({"a": [lv(1.0), lv(2.0), lv("inf")], "b": [lv(4.0), lv(math.inf)]})
    assert xname == "request rate (req/s)"
    assert inf_x == 8.0
    assert xs == {"a": [1.0, 2.0, 8.0], "b": [4.0, 8.0]}
    # --max-concurrency 0,2,4: 0 means no cap, i.e. more load than 4, placed after it on the concurrency axis
    xname, xs, inf_x = plot_xs({"c": [lv(math.inf), lv(math.inf, 2), lv(math.inf, 4)]})
    assert (xname, xs, inf_x) == ("max concurrency", {"c": [8.0, 2.0, 4.0]}, 8.0)
    # a rate sweep without inf is unchanged
    assert plot_xs({"a": [lv(0.5), lv(1.0)]}) == ("request rate (req/s)", {"a": [0.5, 1.0]}, None)
    # the default run, one level at rate inf, is on a rate axis
    assert plot_xs({"d": [lv(math.inf)]}) == ("request rate (req/s)", {"d": [1.0]}, 1.0)
    # a trace replay has no load axis
    assert plot_xs({"t": [lv(None)]}) == ("level", {"t": [0.0]}, None)


def test_throughput_plot_leaves_out_what_was_not_measured():
    # without --goodput and without prefix-cache counters the table prints '-': the plot must not draw a 0 line
    from dlmix.bench.report import throughput_series

    lv = lambda good, rate: {"metrics": {"output_throughput": 12.5, "request_goodput": good}, "prefix": {"rate": rate}}
    out, good, hit = throughput_series([lv(None, None), lv(0.0, 0.25), lv(1.5, 0.0)])
    assert out == [12.5, 12.5, 12.5]
    assert math.isnan(good[0]) and good[1:] == [0.0, 1.5]
    assert math.isnan(hit[0]) and hit[1:] == [25.0, 0.0]
