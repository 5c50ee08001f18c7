"""dlmix.bench.workloads: seeded, deterministic workloads; trace hash ids map to shared token blocks."""
from __future__ import annotations

import json

import numpy as np
import pytest

from dlmix.bench.workloads import (WorkloadError, arrival_times, hash_block, ideal_prefix_reuse,
                                   load_mooncake_trace, random_prompts, shared_prefix)


def test_shared_prefix_groups_share_exact_prefix_and_unique_suffix():
    reqs = shared_prefix(3, 4, prefix_len=40, suffix_len=8, output_len=5, seed=7)
    assert len(reqs) == 12
    by_group = {}
    for r in reqs:
        assert len(r.prompt) == 48 and r.output_len == 5
        assert all(10 <= t < 256 for t in r.prompt)
        by_group.setdefault(r.group, []).append(r.prompt)
    assert sorted(by_group) == [0, 1, 2]
    prefixes = {g: {tuple(p[:40]) for p in ps} for g, ps in by_group.items()}
    assert all(len(s) == 1 for s in prefixes.values())           # one prefix per group
    assert len({next(iter(s)) for s in prefixes.values()}) == 3   # groups differ
    assert len({tuple(r.prompt[40:]) for r in reqs}) == 12        # suffixes unique
    again = shared_prefix(3, 4, 40, 8, 5, seed=7)
    assert [r.prompt for r in again] == [r.prompt for r in reqs]
    assert [r.prompt for r in shared_prefix(3, 4, 40, 8, 5, seed=8)] != [r.prompt for r in reqs]
    # ideal reuse with 8-token blocks: per group 3 of 4 prompts hit 40 tokens (5 blocks)
    assert ideal_prefix_reuse(reqs, 8) == pytest.approx(3 * 3 * 40 / (12 * 48))


def test_random_prompts_seeded():
    a, b = random_prompts(5, 12, 3, seed=1), random_prompts(5, 12, 3, seed=1)
    assert [r.prompt for r in a] == [r.prompt for r in b]
    assert {len(r.prompt) for r in a} == {12}
    with pytest.raises(WorkloadError):
        random_prompts(0, 12, 3)


def test_hash_block_is_deterministic_and_distinct():
    assert hash_block(42, 512) == hash_block(42, 512)
    assert len(hash_block(42, 512)) == 512
    assert hash_block(42, 512) != hash_block(43, 512)
    assert hash_block(42, 512, seed=1) != hash_block(42, 512, seed=0)


def test_mooncake_equal_hash_ids_give_equal_token_blocks(tmp_path):
    lines = [
        {"timestamp": 1000, "input_length": 1100, "output_length": 7, "hash_ids": [1, 2, 3]},
        {"timestamp": 1500, "input_length": 1024, "output_length": 9, "hash_ids": [1, 2]},
        {"timestamp": 2500, "input_length": 600, "output_length": 2, "hash_ids": [1, 9]},
    ]
    p = tmp_path / "trace.jsonl"
    p.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    reqs = load_mooncake_trace(p)
    assert [len(r.prompt) for r in reqs] == [1100, 1024, 600]
    assert [r.output_len for r in reqs] == [7, 9, 2]
    assert [r.arrival_s for r in reqs] == [0.0, 0.5, 1.5]
    assert reqs[0].prompt[:1024] == reqs[1].prompt                     # ids 1, 2 shared
    assert reqs[0].prompt[:512] == reqs[2].prompt[:512] == hash_block(1)  # id 1 shared by all
    assert reqs[2].prompt[512:] == hash_block(9)[:88]
    assert reqs[0].prompt[512:600] != reqs[2].prompt[512:600]                 # ids 2 and 9 differ
    # scaled down: 32 tokens per hash id, lengths scaled by 32/512
    small = load_mooncake_trace(p, block_tokens=32, time_scale=2.0)
    assert [len(r.prompt) for r in small] == [69, 64, 38]
    assert small[0].prompt[:64] == small[1].prompt
    assert small[0].prompt[:32] == hash_block(1, 32)
    assert [r.arrival_s for r in small] == [0.0, 1.0, 3.0]


def test_mooncake_bad_line_names_file_and_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n{"timestamp": 1}\n')
    with pytest.raises(WorkloadError, match=r"bad.jsonl:2: invalid Mooncake record"):
        load_mooncake_trace(p)


def test_poisson_arrivals_seeded_and_mean_rate():
    a, b = arrival_times(2000, 4.0, seed=3), arrival_times(2000, 4.0, seed=3)
    assert a == b
    assert a != arrival_times(2000, 4.0, seed=4)
    gaps = np.diff([0.0] + a)
    assert (gaps > 0).all()
    assert gaps.mean() == pytest.approx(0.25, rel=0.08)        # mean gap 1/rate
    assert gaps.std() == pytest.approx(0.25, rel=0.12)         # exponential: std == mean
    bursty = np.diff([0.0] + arrival_times(2000, 4.0, burstiness=0.25, seed=3))
    assert bursty.std() > 1.5 * gaps.std()                     # Gamma shape < 1 is burstier
    assert arrival_times(3, float("inf")) == [0.0, 0.0, 0.0]
    with pytest.raises(WorkloadError):
        arrival_times(3, 0.0)


def test_infinite_burstiness_is_constant_gaps_and_bad_values_are_refused():
    assert arrival_times(4, 2.0, burstiness=float("inf")) == [0.5, 1.0, 1.5, 2.0]  # vLLM's limit: gaps 1/rate
    for rate, burst in ((0.0, 1.0), (-1.0, 1.0), (1.0, 0.0), (1.0, -2.0), (float("nan"), 1.0), (1.0, float("nan"))):
        with pytest.raises(WorkloadError, match="request rate and burstiness must be > 0"):
            arrival_times(3, rate, burst)


def test_builtin_mooncake_conversation_trace_shares_prefixes():
    import gzip

    from dlmix.bench.workloads import resolve_trace

    path = resolve_trace("mooncake-conversation")
    with gzip.open(path, "rt") as f:
        recs = [json.loads(next(f)) for _ in range(300)]
    reqs = load_mooncake_trace("mooncake-conversation", block_tokens=16, max_requests=300)
    assert len(reqs) == 300
    # find two requests whose first two hash ids agree: their first 32 tokens agree as well
    seen = {}
    pairs = 0
    for i, rec in enumerate(recs):
        key = tuple(rec["hash_ids"][:2])
        if len(key) == 2 and key in seen and len(reqs[i].prompt) >= 32 and len(reqs[seen[key]].prompt) >= 32:
            assert reqs[i].prompt[:32] == reqs[seen[key]].prompt[:32]
            pairs += 1
        seen.setdefault(key, i)
    assert pairs > 0


@pytest.mark.parametrize("make, message", [
    (lambda: random_prompts(2, 2_000_000_000, 4), "random workload: input_len must be at most 1048576 tokens, got "
                                                  "2000000000"),
    (lambda: random_prompts(2_000_000_000, 4, 4), "random workload: num_prompts must be at most 100000, got "
                                                  "2000000000"),
    (lambda: random_prompts(2, 4, 10 ** 9), "random workload: output_len must be at most 1048576 tokens, got "
                                            "1000000000"),
    (lambda: random_prompts(100_000, 100_000, 4), "random workload: 100000 prompts × 100000 tokens is more than "
                                                  "67108864 prompt tokens in all"),
    (lambda: shared_prefix(1000, 100, 1_000_000, 32, 4), "shared-prefix workload: 100000 prompts × 1000032 tokens "
                                                         "is more than 67108864 prompt tokens in all"),
])
def test_huge_synthetic_workloads_are_refused_before_any_prompt_is_generated(make, message):
    """A typo such as ``--random-input-len 2000000000`` ended ``dlmix bench`` in a MemoryError traceback, and
    ``--num-prompts 2000000000`` generated prompts until killed: the bounds of the shared-prefix workload (requests,
    tokens per prompt) and a bound on the prompt tokens of a level are checked first."""
    with pytest.raises(WorkloadError) as e:
        make()
    assert str(e.value) == message
