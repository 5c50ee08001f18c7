"""The engine-neutral test helpers of :mod:`dlmix.testing` that the end-to-end tests lean on."""
from __future__ import annotations

import threading

import pytest

from dlmix.testing import side_by_side


def test_side_by_side_pairs_in_order_with_references_in_another_thread():
    main = threading.get_ident()
    seen: list[tuple[str, int, int]] = []

    def run(x):
        seen.append(("run", x, threading.get_ident()))
        return x * 10

    def ref(x):
        seen.append(("ref", x, threading.get_ident()))
        return -x

    assert side_by_side([3, 1, 2], run, ref) == [(30, -3), (10, -1), (20, -2)]
    assert [x for k, x, _ in seen if k == "run"] == [3, 1, 2]
    assert [x for k, x, _ in seen if k == "ref"] == [3, 1, 2]  # in order, one after the other
    assert {t for k, _, t in seen if k == "run"} == {main}
    refs_threads = {t for k, _, t in seen if k == "ref"}
    assert len(refs_threads) == 1 and main not in refs_threads


def test_side_by_side_raises_from_either_side():
    with pytest.raises(ValueError, match="run 2"):
        side_by_side([1, 2, 3], lambda x: (_ for _ in ()).throw(ValueError(f"run {x}")) if x == 2 else x, abs)
    with pytest.raises(KeyError, match="ref 3"):
        side_by_side([1, 2, 3], abs, lambda x: (_ for _ in ()).throw(KeyError(f"ref {x}")) if x == 3 else x)


def test_stop_all_stops_every_server_at_once_and_raises_after_all_stopped():
    """``stop_all``: every ``stop()`` runs at the same time (each waits at a barrier all of them must reach), every
    server is stopped even when one's ``stop()`` raises, and that exception comes out afterwards."""
    from dlmix.testing import stop_all

    barrier = threading.Barrier(4, timeout=30)
    stopped = []

    class Server:
        def __init__(self, name, fail=False):
            self.name, self.fail = name, fail

        def stop(self):
            barrier.wait()  # BrokenBarrierError unless all four stop() calls run together
            stopped.append(self.name)
            if self.fail:
                raise RuntimeError(f"{self.name} would not stop")

    with pytest.raises(RuntimeError, match="b would not stop"):
        stop_all(Server(n, fail=n == "b") for n in "abcd")
    assert sorted(stopped) == ["a", "b", "c", "d"]
    stop_all([])


def test_cpu_gemm_upcasts_the_dtypes_torch_has_no_native_kernel_for():
    """:mod:`dlmix.testing.cpu_gemm`: the slow dtypes are what torch's oneDNN reports for this CPU; a product of 16
    rows or more in a slow dtype equals the fp32 product rounded once, bit for bit; fewer rows, and dtypes not
    named, are ``F.linear`` itself."""
    import torch
    import torch.nn.functional as F

    from dlmix.testing import cpu_gemm

    mk = torch.ops.mkldnn
    want = {d for d, native in ((torch.float16, mk._is_mkldnn_fp16_supported()),
                                (torch.bfloat16, mk._is_mkldnn_bf16_supported())) if not native}
    assert cpu_gemm.slow_gemm_dtypes() == frozenset(want)
    g = torch.Generator().manual_seed(0)
    for dt in (torch.bfloat16, torch.float16):
        w, b = torch.randn(48, 64, generator=g).to(dt), torch.randn(48, generator=g).to(dt)
        for rows in (16, 40):
            x = torch.randn(2, rows // 2, 64, generator=g).to(dt)
            y = cpu_gemm.linear(x, w, b, upcast=frozenset({dt}))
            assert y.shape == (2, rows // 2, 48) and y.dtype == dt
            assert torch.equal(y, F.linear(x.float(), w.float(), b.float()).to(dt))
        x = torch.randn(15, 64, generator=g).to(dt)
        assert not cpu_gemm.wants_fp32(x, frozenset({dt}))
        assert torch.equal(cpu_gemm.linear(x, w, b, upcast=frozenset({dt})), F.linear(x, w, b))
        x = torch.randn(40, 64, generator=g).to(dt)
        assert torch.equal(cpu_gemm.linear(x, w, None, upcast=frozenset()), F.linear(x, w))
    x32 = torch.randn(40, 64, generator=g)
    assert not cpu_gemm.wants_fp32(x32, frozenset({torch.float16, torch.bfloat16}))


def test_spread_lengths_are_geometric_strictly_increasing_and_end_at_both_bounds():
    from dlmix.testing import spread_lengths

    got = spread_lengths(20)
    assert got == [10, 13, 16, 21, 26, 34, 43, 55, 70, 89, 113, 144, 183, 234, 298, 379, 483, 616, 785, 1000]
    assert round(sum(got) / len(got)) == 231  # against 505 for 20 lengths spread evenly over 10..1,000
    assert spread_lengths(4, 1, 4) == [1, 2, 3, 4]  # steps under one token become one
    for bad in ((5, 1, 4), (1, 10, 1000), (3, 0, 10), (3, 10, 10)):
        with pytest.raises(ValueError):
            spread_lengths(*bad)


def test_compare_greedy_takes_an_equal_early_stop_and_fails_a_cut_or_clear_divergence():
    from dlmix.testing import compare_greedy

    gaps = [2.0, 2.0, 0.1, 2.0]
    # both stopped at end-of-text (id 2) after 3 tokens: identical
    assert compare_greedy("c", {0: [5, 6, 2]}, {0: ([5, 6, 2], gaps)}, 0.5, 4) == (1, 0)
    assert compare_greedy("c", {0: [5, 6, 7, 8]}, {0: ([5, 6, 7, 8], gaps)}, 0.5, 4) == (1, 0)
    # first difference at a near-tie of the reference (gap 0.1 < 0.5): counted
    assert compare_greedy("c", {0: [5, 6, 9, 8]}, {0: ([5, 6, 7, 8], gaps)}, 0.5, 4) == (0, 1)
    with pytest.raises(AssertionError, match="token 1"):  # a clear divergence
        compare_greedy("c", {0: [5, 9, 7, 8]}, {0: ([5, 6, 7, 8], gaps)}, 0.5, 4)
    with pytest.raises(AssertionError, match="token 1"):  # an answer cut short where the reference was sure
        compare_greedy("c", {0: [5]}, {0: ([5, 6, 7, 8], gaps)}, 0.5, 4)
    with pytest.raises(AssertionError):  # more ids than asked for, or none
        compare_greedy("c", {0: [5, 6, 7, 8, 9]}, {0: ([5, 6, 7, 8], gaps)}, 0.5, 4)
    with pytest.raises(AssertionError):
        compare_greedy("c", {0: []}, {0: ([5, 6, 7, 8], gaps)}, 0.5, 4)


def test_spread_lengths_shuffled_puts_both_ends_first():
    import random

    from dlmix.testing import spread_lengths

    got = spread_lengths(10, 10, 600, shuffle=random.Random(3))
    assert got[:2] == [10, 600] and sorted(got) == spread_lengths(10, 10, 600)
