"""`dlmix demo`'s check of every answer against a single instance (fast: the decision logic on recorded responses).

The end-to-end run is tests/test_demo.py."""
from __future__ import annotations

import json
import math

import httpx
import pytest

from dlmix import demo as D


def test_first_divergence_counts_tokens():
    toks = ["Paris", " is", " the", " capital", "."]
    assert D.first_divergence("Paris is the capital.", toks) is None
    assert D.first_divergence("Paris is a capital.", toks) == 2
    assert D.first_divergence("Lyon", toks) == 0
    assert D.first_divergence("Paris is the capital. Yes", toks) == 5  # goes on past the reference
    assert D.first_divergence("Paris is", toks) == 2  # stops early: differs at the first token it lacks


def _text(tokens):  # the answer text leaves the end-of-turn token out, its logprobs do not
    return "".join(t for t in tokens if t != "<|im_end|>")


def _chat_response(tokens, tops):
    return {"choices": [{"message": {"content": _text(tokens)}, "logprobs": {"content": [
        {"token": t, "logprob": top[0], "top_logprobs": [{"token": t, "logprob": top[0]},
                                                         {"token": "x", "logprob": top[1]}]}
        for t, top in zip(tokens, tops)]}}]}


def _completion_response(tokens, tops):
    return {"choices": [{"text": _text(tokens), "logprobs": {
        "tokens": tokens, "top_logprobs": [{t: a, "x": b} for t, (a, b) in zip(tokens, tops)]}}]}


@pytest.mark.parametrize("path,make", [("/v1/chat/completions", _chat_response),
                                       ("/v1/completions", _completion_response)])
@pytest.mark.parametrize("answer,tops,expect", [
    ("Red, green and blue.", [(-0.1, -3.0)] * 5, "same"),
    # the end-of-turn token is in the logprobs but not in the answer text, as in the stream
    ("Red, green and blue.", [(-0.1, -3.0)] * 6, "same"),
    ("Red, yellow and blue.", [(-0.1, -3.0), (-0.1, -3.0), (-0.7, -0.9), (-0.1, -3.0), (-0.1, -3.0)], "near-tie@2"),
    ("Red, yellow and blue.", [(-0.1, -3.0)] * 5, "DIFFERS@2"),
])
def test_check_single_classifies_answers(path, make, answer, tops, expect):
    tokens = ["Red", ",", " green", " and", " blue."] + (["<|im_end|>"] if len(tops) == 6 else [])
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return httpx.Response(200, json=make(tokens, tops))

    body = {"model": "m", "max_tokens": 5, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    body.update({"messages": [{"role": "user", "content": "colors?"}]} if "chat" in path else {"prompt": "colors"})
    req = D.DemoRequest("q", path, body)
    row = D.DemoRow("q", ok=True, text=answer)
    with httpx.Client(transport=httpx.MockTransport(handler)) as c:
        D._check_single(c, "http://decode", req, row)
    assert row.single == expect
    sent = seen[0]
    # the reference is the same request, greedy and whole, on a fresh prefix-cache salt, with top-2 logprobs
    assert sent["stream"] is False and "stream_options" not in sent
    assert sent["cache_salt"].startswith("dlmix-demo-") and len(sent["cache_salt"]) == len("dlmix-demo-") + 16
    assert (sent["logprobs"], sent.get("top_logprobs")) == ((True, 2) if "chat" in path else (2, None))
    assert {k: sent[k] for k in ("model", "max_tokens", "temperature")} == {"model": "m", "max_tokens": 5,
                                                                          "temperature": 0}
    if expect != "same":
        a, b = tops[2]
        assert math.isclose(row.extra["single_gap_nats"], a - b)


def test_check_single_reports_a_failed_reference():
    row = D.DemoRow("q", ok=True, text="x")
    with httpx.Client(transport=httpx.MockTransport(lambda r: httpx.Response(500, text="boom"))) as c:
        D._check_single(c, "http://decode", D.DemoRequest("q", "/v1/completions", {"prompt": "p"}), row)
    assert row.single == "error: HTTP 500: boom"
