"""The transport registry is a one-file extension point: a third-party transport declared under the
``dlmix.transports`` entry-point group of a distribution outside dlmix is listed, validated by the vLLM settings,
built by ``make_transport`` and moves real bytes between two processes (``dlmix_kv_connectors.testing``), without
editing any dlmix file."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import dlmix_kv_connectors as kv
from dlmix_kv_connectors import Segment, make_transport
from dlmix_kv_connectors.testing import PeerProcess, pattern, sha
from dlmix.testing import poll

SECRET = "registry-secret"
REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.no_engine_servers  # its slow test runs a child pytest: no engine server

PLUGIN = '''
"""A third-party dlmix transport: the built-in TCP data path under its own kind, with a marker in its descriptor."""
from dlmix_kv_connectors.tcp import TcpTransport


class XTcpTransport(TcpTransport):
    def _dp_descriptor(self) -> dict:
        return {"plugin": "dlmix-xtcp"}
'''


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
    """A distribution ``dlmix-xtcp`` (module + dist-info with entry points) in a temporary directory on sys.path."""
    (tmp_path / "dlmix_xtcp.py").write_text(PLUGIN)
    info = tmp_path / "dlmix_xtcp-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: dlmix-xtcp\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(textwrap.dedent("""\
        [dlmix.transports]
        xtcp = dlmix_xtcp:XTcpTransport
        xbroken = dlmix_xtcp:NoSuchClass
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    yield tmp_path
    sys.modules.pop("dlmix_xtcp", None)


def test_builtin_kinds_are_the_package_files():
    files = {p.stem for p in (REPO / "kv_connectors").glob("*.py")} - {"__init__", "base", "testing"}
    assert set(kv.BUILTIN_KINDS) == {f for f in files if not f.startswith("_")} >= {"tcp", "shm", "nixl"}
    assert set(kv.transport_kinds()) >= set(kv.BUILTIN_KINDS)


def test_entry_point_transport_listed_validated_built_and_moves_bytes(plugin_dir):
    assert "dlmix_xtcp" not in sys.modules
    kinds = kv.transport_kinds()
    assert {"xtcp", "xbroken"} <= set(kinds) and "dlmix_xtcp" not in sys.modules  # listed without importing

    # the vLLM settings accept the registry's kinds and refuse others with the known ones
    from dlmix_vllm.config import DLMixConfigError, parse_settings

    assert parse_settings({"transport": "xtcp"}).transport == "xtcp"
    with pytest.raises(DLMixConfigError, match=r"unknown transport 'nope'.*xtcp"):
        parse_settings({"transport": "nope"})

    # a broken entry point is a clear error naming it, not an AttributeError
    with pytest.raises(ValueError, match="xbroken.*NoSuchClass"):
        make_transport("xbroken", name="b", secret=SECRET)
    assert kv.available_transports()["xtcp"] is None

    # two processes: the owner is a peer process (it finds the plugin through PYTHONPATH), this one pulls and pushes
    peer = PeerProcess("xtcp", "owner", SECRET)
    local = make_transport("xtcp", name="local", secret=SECRET)
    try:
        assert type(local).__name__ == "XTcpTransport" and local.kind == "xtcp"
        assert peer.desc["kind"] == "xtcp" and peer.desc["plugin"] == "dlmix-xtcp"
        size = 3 << 20
        assert peer.call("region", name="kv", size=size, seed=7)["ok"]
        assert peer.call("grant", peer="local", tid="t1", ranges=[["kv", 0, size]], mode="rw")["ok"]
        dst = np.zeros(size, dtype=np.uint8)
        local.register("kv", dst)
        assert local.connect(peer.desc) == "owner"
        # many small blocks (one frame) and one large piece
        segs = [Segment("kv", i * 4096, "kv", i * 4096, 4096) for i in range(64)] + \
               [Segment("kv", 1 << 20, "kv", 1 << 20, 2 << 20)]
        assert local.read("owner", segs, "t1").result(60) == 64 * 4096 + (2 << 20)
        want = pattern(size, 7)
        assert np.array_equal(dst[:64 * 4096], want[:64 * 4096]) and np.array_equal(dst[1 << 20:], want[1 << 20:])
        src = pattern(1 << 20, 99)
        local.register("src", src)
        assert local.write("owner", [Segment("src", 0, "kv", 0, 1 << 20)], "t1").result(60) == 1 << 20
        assert peer.call("sha", name="kv", off=0, len=1 << 20)["sha"] == sha(src)
        # outside the grant: refused by the owner
        assert peer.call("grant", peer="local", tid="t2", ranges=[["kv", 0, 4096]], mode="r")["ok"]
        with pytest.raises(kv.GrantError):
            local.read("owner", [Segment("kv", 0, "kv", 4096, 4096)], "t2").result(30)
    finally:
        local.close()
        peer.close()


@pytest.mark.slow
def test_entry_point_transport_passes_contract_cases(plugin_dir):
    """The contract suite picks up installed third-party kinds: run a few of its cases for ``xtcp``."""
    cases = "xtcp and (read_write_bytes_verified or out_of_grant_refused or wrong_secret_refused or notifications)"
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", cases,
                        str(REPO / "tests" / "test_transport_contract.py")],
                       capture_output=True, text=True, timeout=600, cwd=str(REPO))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "4 passed" in r.stdout, r.stdout[-2000:]


def test_plugin_transport_carries_a_pd_pull_through_the_pd_core(plugin_dir):
    """The outside distribution's ``xtcp`` kind under the engine-neutral PD core: the producer endpoint holds blocks
    and grants them, the consumer pulls them over ``xtcp`` and converts arrangement, block size and dtype; the
    values read back equal what was written, and the hold is released."""
    import torch

    from dlmix.kv import KVLayout, ModelIdentity
    from dlmix.kv.ops import allocate, read_kv, torch_dtype, write_kv
    from dlmix.pd.consumer import claim
    from dlmix.pd.contract import TransferParams, prompt_digest
    from dlmix.pd.endpoint import KVEndpoint

    model = ModelIdentity("LlamaForCausalLM", 2, 2, 16, "gqa", weights_fingerprint="sha256:aa")
    src = KVLayout(model=model, block_size=64, dtype="bf16", arrangement="lmdeploy")
    dst = KVLayout(model=model, block_size=32, dtype="fp32", arrangement="vllm_cpu")
    n, start = 150, 40
    sblocks = [13, 11, 12]
    dblocks = [5, 2, 7, 1, 3]
    sc, dc = allocate(src, 16), allocate(dst, 8)
    g = torch.Generator().manual_seed(3)
    ref = {}
    for t in range(n):
        for layer in range(model.num_layers):
            k, v = (torch.randn(src.num_local_heads, model.head_size, generator=g).to(torch_dtype(src)) for _ in "kv")
            write_kv(src, sc, sblocks, t, layer, k, v)
            ref[(t, layer)] = (k, v)
    p = KVEndpoint("xtcp", "prod", SECRET, "127.0.0.1", 0, src, sc, 0, registration_wait_s=1.0, io_timeout_s=10.0)
    d = KVEndpoint("xtcp", "cons", SECRET, "127.0.0.1", 0, dst, dc, 2 * src.block_bytes(), registration_wait_s=1.0,
                   io_timeout_s=10.0)
    try:
        desc = p.descriptor()
        assert desc["kind"] == "xtcp" and desc["plugin"] == "dlmix-xtcp"
        assert type(p.t).__name__ == type(d.t).__name__ == "XTcpTransport"
        digest = prompt_digest(range(n))
        params = TransferParams.make(engine="reference", instance_id="p0", transports=[desc], request_id="req",
                                     block_ids=sblocks, num_tokens=n, layout=src, digest=digest)
        p.add_hold("req", sblocks, n, digest)
        c = claim(params.to_dict(), dst, n + 1, start, prompt_token_ids=list(range(n + 1)))
        res = d.pull_params(c.params, c.start, c.end, dblocks, digest=digest)
        assert res.error is None and res.loaded_upto == n and res.failed_block_ids == [], res
        for t in range(start, n):
            for layer in range(model.num_layers):
                k, v = read_kv(dst, dc, dblocks, t, layer)
                rk, rv = ref[(t, layer)]
                assert torch.equal(k, rk.to(torch.float32)) and torch.equal(v, rv.to(torch.float32)), (t, layer)
        k, _ = read_kv(dst, dc, dblocks, start - 1, 0)
        assert torch.count_nonzero(k) == 0  # the consumer's own prefix is not overwritten
        d.release(desc, "req", consumed=True)
        done = poll(p.take_finished, timeout_s=60)
        assert done == {"req"} and p.held_count() == 0
    finally:
        p.close()
        d.close()
