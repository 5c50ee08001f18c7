"""KV arrangements are one file each: a new one defined outside the package, registered by decorator or by a
``dlmix.kv_arrangements`` entry point, converts to and from the built-ins with exact equality."""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from dlmix.kv import ARRANGEMENTS, KVLayout, ModelIdentity, allocate, convert, read_kv  # noqa: E402
from dlmix.kv import registry  # noqa: E402

# A made-up engine that keeps K and V of a block side by side, each transposed: [B, 2, H, D, N].
PLUGIN = textwrap.dedent('''
    """A toy engine arrangement: [B, 2, H, D, N] (K and V of a block adjacent, each stored head, element, token)."""
    from dlmix.kv.registry import Arrangement, register


    @register("toy_hdn")
    class ToyHDN(Arrangement):
        def layer_shape(self, B, N, H, D):
            return (B, 2, H, D, N)

        def check_layout(self, layout):
            if layout.block_size % 2:
                raise ValueError("toy_hdn needs an even block size")

        def plane_views(self, cache, N, H, D):
            self.expect_shape(cache, self.layer_shape(self.num_blocks_of(cache), N, H, D))
            return (cache[:, 0].permute(0, 3, 1, 2), cache[:, 1].permute(0, 3, 1, 2))
''')

MODEL = ModelIdentity("LlamaForCausalLM", num_layers=2, num_kv_heads=4, head_size=8, attention="gqa")


def _fill(caches, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for c in caches:
        for t in (c if isinstance(c, tuple) else (c,)):
            t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))


def _round_trip(name: str) -> None:
    """flash NHD (block 16) -> ``name`` (block 8, TP 2 rank 1) -> lmdeploy (block 4), token by token exact."""
    src = KVLayout(MODEL, 16, "bf16", "vllm_flash_nhd", tp_size=2, tp_rank=1)
    mid = KVLayout(MODEL, 8, "bf16", name, tp_size=2, tp_rank=1)
    dst = KVLayout(MODEL, 4, "bf16", "lmdeploy", tp_size=2, tp_rank=1)
    n, skip = 37, 5
    sc, mc, dc = allocate(src, 4), allocate(mid, 8, fill=7.0), allocate(dst, 12, fill=7.0)
    _fill(sc, 1)
    sb, mb, db = [3, 0, 2], [7, 1, 6, 0, 2, 5, 3, 4][:5], list(range(11, 1, -1))
    assert convert(src, sc, sb, mid, mc, mb, n) == mid.wire_bytes(n)
    convert(mid, mc, mb, dst, dc, db, n, skip)
    for layer in range(MODEL.num_layers):
        for t in range(n):
            want = read_kv(src, sc, sb, t, layer)
            got_mid = read_kv(mid, mc, mb, t, layer)
            assert torch.equal(want[0], got_mid[0]) and torch.equal(want[1], got_mid[1])
            got = read_kv(dst, dc, db, t, layer)
            if t < skip:  # the destination's own prefix: untouched
                assert bool((got[0].float() == 7.0).all()) and bool((got[1].float() == 7.0).all())
            else:
                assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
    # the middle cache really is [B, 2, H, D, N]: K of token 9 (block mb[1], offset 1), head 0 is at [..., 0, :, 1]
    k9 = read_kv(src, sc, sb, 9, 0)[0][0]
    assert torch.equal(mc[0][mb[1], 0, 0, :, 1], k9)


def test_builtin_arrangements_are_registered() -> None:
    assert {"vllm_cpu", "vllm_flash_nhd", "vllm_flash_hnd", "sglang_nhd", "lmdeploy", "mla"} <= set(ARRANGEMENTS)
    assert ARRANGEMENTS["sglang_hnd"] == (True, False) and ARRANGEMENTS["mla"] == (False, True)
    with pytest.raises(ValueError, match="unknown arrangement 'nope'; known: .*vllm_cpu"):
        KVLayout(MODEL, 16, "bf16", "nope")


def test_arrangement_from_a_file_outside_the_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "toy_kv_plugin.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        importlib.import_module("toy_kv_plugin")
        assert "toy_hdn" in ARRANGEMENTS and ARRANGEMENTS["toy_hdn"] == (False, False)
        assert KVLayout(MODEL, 8, "bf16", "toy_hdn").layer_shape(3) == (3, 2, 4, 8, 8)
        with pytest.raises(ValueError, match="even block size"):
            KVLayout(MODEL, 3, "bf16", "toy_hdn")
        _round_trip("toy_hdn")
        # a second class may not take the name silently
        with pytest.raises(ValueError, match="already registered"):
            registry.register("toy_hdn")(type("Other", (registry.Arrangement,), {}))
    finally:
        registry.unregister("toy_hdn")
        sys.modules.pop("toy_kv_plugin", None)
    assert "toy_hdn" not in ARRANGEMENTS


def _distribution(where: Path, module: str, source: str, entry_point: str) -> None:
    """A bare installed distribution in ``where``: ``module``.py holding ``source`` and a ``.dist-info`` declaring
    ``entry_point`` (``name = value``) in the ``dlmix.kv_arrangements`` group."""
    (where / f"{module}.py").write_text(source)
    info = where / f"{module}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module.replace('_', '-')}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[dlmix.kv_arrangements]\n{entry_point}\n")


def test_arrangement_from_an_entry_point(tmp_path: Path) -> None:
    """An installed distribution (here a bare ``.dist-info`` on the path) declares the module in the
    ``dlmix.kv_arrangements`` group; a fresh process finds it by name without importing it first."""
    _distribution(tmp_path, "toy_kv_plugin", PLUGIN, "toy_hdn = toy_kv_plugin")
    code = textwrap.dedent("""
        import sys
        sys.path.insert(0, sys.argv[1])
        import test_kv_arrangements as t
        assert "toy_kv_plugin" not in sys.modules
        t._round_trip("toy_hdn")
        print("ok", "toy_hdn" in t.ARRANGEMENTS)
    """)
    env_path = [str(tmp_path), str(Path(__file__).parent), *sys.path]
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "PYTHONPATH": ":".join(p for p in env_path if p)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["ok", "True"]


def test_an_entry_point_under_a_taken_name_is_ignored_with_a_warning(tmp_path: Path) -> None:
    """A class published under a built-in arrangement's name is never used (the built-in keeps the name); the first
    lookup says so with a RuntimeWarning naming the entry point and the holder (before: silently ignored)."""
    _distribution(tmp_path, "toy_taken", "from dlmix.kv.registry import Arrangement\n\n\n"
                  "class Taken(Arrangement):\n    pass\n", "vllm_cpu = toy_taken:Taken")
    code = textwrap.dedent("""
        import sys, warnings
        sys.path.insert(0, sys.argv[1])
        from dlmix.kv.registry import arrangement_names, get_arrangement
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            names = arrangement_names()
        print(type(get_arrangement("vllm_cpu")).__module__)
        print("|".join(str(x.message) for x in w if issubclass(x.category, RuntimeWarning)))
    """)
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ,
                              "PYTHONPATH": ":".join(p for p in [str(tmp_path), *sys.path] if p)})
    assert out.returncode == 0, out.stderr[-3000:]
    holder, warned = out.stdout.splitlines()
    assert holder.startswith("dlmix.kv.arrangements")
    assert "'vllm_cpu' = 'toy_taken:Taken' is ignored" in warned and "dlmix.kv.arrangements" in warned, warned
