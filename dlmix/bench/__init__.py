"""``dlmix bench``: load generator for any OpenAI-compatible endpoint (a dlmix router or a single engine).

Modules: :mod:`~dlmix.bench.workloads` (shared-prefix, random, Mooncake trace; seeded arrivals),
:mod:`~dlmix.bench.client` (async streaming client), :mod:`~dlmix.bench.stats` (vLLM ``bench serve`` metric
definitions), :mod:`~dlmix.bench.scrape` (prefix-hit counters), :mod:`~dlmix.bench.runner` (levels and sweeps),
:mod:`~dlmix.bench.report` (table, JSON, plots), :mod:`dlmix.testing.mock_engine` (test engine),
:mod:`~dlmix.bench.cli` (command line). See docs/bench.md.
"""
