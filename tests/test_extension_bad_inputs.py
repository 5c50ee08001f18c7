"""Bad input at the extension points is a clear error naming the problem, never silent acceptance: a chip file with
non-finite or mistyped figures or an alias taking over another chip; `dlmix sim --chips`; a policy whose parameter
default has the wrong type or whose entry point is shadowed by a built-in; a transport or KV arrangement of another
module under a built-in name (whatever was imported first)."""
import subprocess
import sys
import textwrap

import pytest
from typer.testing import CliRunner

from dlmix.hw.profiles import CatalogError, load_catalog

GOOD = "vendor: X, bf16_tflops: 10, mem_bw_gbps: 100, mem_gb: 10, confidence: low, source: s"


def _chips(tmp_path, body, name="c.yaml"):
    p = tmp_path / name
    p.write_text(textwrap.dedent(body))
    return p


@pytest.mark.parametrize("entry, match", [
    ("{vendor: X, bf16_tflops: .nan, mem_bw_gbps: 100, mem_gb: 10}", "bf16_tflops must be a finite number"),
    ("{vendor: X, bf16_tflops: 10, mem_bw_gbps: .inf, mem_gb: 10}", "mem_bw_gbps must be a finite number"),
    ("{vendor: X, bf16_tflops: true, mem_bw_gbps: 100, mem_gb: 10}", "bf16_tflops must be a number, got bool"),
    ("{vendor: X, bf16_tflops: lots, mem_bw_gbps: 100, mem_gb: 10}", "bf16_tflops must be a number, got str"),
    ("{" + GOOD + ", aliases: H100}", "aliases must be a list of names"),
    ("{" + GOOD + ", aliases: [h100]}", "alias 'h100' already names chip 'H100'"),
    ("{vendor: X, bf16_tflops: 10, mem_bw_gbps: 100, mem_gb: 10, confidence: extreme}", "confidence must be one of"),
    ("{vendor: [1, 2], bf16_tflops: 10, mem_bw_gbps: 100, mem_gb: 10}", "vendor must be a string"),
])
def test_bad_chip_entries_are_refused_naming_file_chip_and_key(tmp_path, entry, match):
    p = _chips(tmp_path, f"chips:\n  BadChip: {entry}\n")
    with pytest.raises(CatalogError, match=match) as ei:
        load_catalog([p])
    assert str(p) in str(ei.value) and "BadChip" in str(ei.value)
    assert load_catalog().chip("H100").name == "H100"  # nothing taken over


def test_good_chip_file_still_loads_and_quoted_numbers_are_numbers(tmp_path):
    p = _chips(tmp_path, f"""\
        chips:
          Good1: {{{GOOD}, aliases: [g1, 7]}}
          Good2: {{vendor: X, bf16_tflops: "12.5", mem_bw_gbps: 100, mem_gb: 10}}
          H100: {{mem_gb: 96, aliases: [H100-SXM]}}
        """)
    cat = load_catalog([p])
    assert cat.chip("g1").name == "Good1" and cat.chip("7").name == "Good1"
    assert cat.chip("Good2").bf16_tflops == 12.5
    assert cat.chip("h100-sxm").mem_gb == 96  # overriding a chip under its own name stays allowed


def test_sim_takes_chips_files(tmp_path):
    from dlmix.cli import app

    chips = _chips(tmp_path, f"chips:\n  SimNPU: {{{GOOD}, aliases: [snpu]}}\n")
    dep = _chips(tmp_path, "name: d\ninstances:\n  - {chip: snpu, count: 1, role: both}\n", "dep.yaml")
    args = ["sim", "-d", str(dep), "-m", "smollm2", "-w", "synthetic", "--groups", "1", "--per-group", "2",
            "--prefix-len", "64", "--suffix-len", "32", "--output-len", "4", "--rate", "1"]
    without = CliRunner().invoke(app, args)
    assert without.exit_code == 2 and "unknown chip 'snpu'" in without.output and "--chips" in without.output
    res = CliRunner().invoke(app, args + ["--chips", str(chips)])
    assert res.exit_code == 0, res.output
    # the instance carries the catalog's chip name, reached by the alias
    assert "SimNPU-both-0" in res.output and "\"completed\": 2" in res.output
    bad = _chips(tmp_path, "chips:\n  B: {vendor: X, bf16_tflops: .nan, mem_bw_gbps: 1, mem_gb: 1}\n", "bad.yaml")
    res = CliRunner().invoke(app, args + ["--chips", str(bad)])
    assert res.exit_code == 2 and "must be a finite number" in res.output and "Traceback" not in res.output


def test_policy_with_an_ill_typed_default_is_refused():
    from dlmix.routing.policies import Policy, PolicyParamError, PolicyParams, make_policy, register_policy
    from dlmix.routing.policies.registry import POLICIES

    @register_policy("test_bad_default_policy")
    class BadDefault(Policy):
        class Params(PolicyParams):
            weight: float = "heavy"

        def score(self, req, cands, view):
            return [self.params.weight for _ in cands]

    try:
        with pytest.raises(PolicyParamError, match=r"weight: .*valid number.*'heavy'"):
            make_policy("test_bad_default_policy")
        assert make_policy("test_bad_default_policy", weight="2").params.weight == 2.0
    finally:
        POLICIES._classes.pop("test_bad_default_policy", None)


def test_policy_entry_point_under_a_builtin_name_warns(tmp_path, monkeypatch):
    root = tmp_path / "site"
    (root / "shadowpol").mkdir(parents=True)
    (root / "shadowpol" / "__init__.py").write_text(
        "from dlmix.routing.policies import Policy\nclass Mine(Policy):\n    pass\n")
    di = root / "shadowpol-0.1.dist-info"
    di.mkdir()
    (di / "METADATA").write_text("Metadata-Version: 2.1\nName: shadowpol\nVersion: 0.1\n")
    (di / "entry_points.txt").write_text("[dlmix.policies]\ncost = shadowpol:Mine\n")
    monkeypatch.syspath_prepend(str(root))
    from dlmix.routing.policies.registry import PolicyRegistry, POLICIES

    reg = PolicyRegistry()
    reg._classes.update(POLICIES._classes)
    with pytest.warns(RuntimeWarning, match=r"'cost' = 'shadowpol:Mine' is ignored.*CostPolicy"):
        assert reg.serving_class("cost") is POLICIES._classes["cost"]


def _run(code):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)


def test_transport_of_another_module_cannot_take_a_builtin_kind():
    # imported before the built-in tcp module: it used to take "tcp" (make_transport("tcp") built it)
    r = _run("""
        from dlmix_kv_connectors import register_transport
        from dlmix_kv_connectors._core import Endpoint
        try:
            @register_transport("tcp")
            class Evil(Endpoint):
                pass
        except ValueError as e:
            print("refused:", e)
        from dlmix_kv_connectors import make_transport
        t = make_transport("tcp", name="a", secret="s" * 32)
        print(type(t).__module__)
        t.close()
        """)
    assert r.returncode == 0, r.stderr
    assert "refused: transport kind 'tcp' is built in" in r.stdout
    assert r.stdout.strip().endswith("dlmix_kv_connectors.tcp")


def test_kv_arrangement_of_another_module_cannot_take_a_builtin_name():
    # before the built-ins are loaded, and with the built-in's class name: both used to be accepted silently
    r = _run("""
        from dlmix.kv.registry import Arrangement, get_arrangement, register
        for qual in ("Evil", "VllmCPU"):
            try:
                register("vllm_cpu")(type(qual, (Arrangement,), {"layer_shape": lambda s, B, N, H, D: (B, N, H, D)}))
                print("accepted", qual)
            except ValueError as e:
                print("refused:", e)
        print(type(get_arrangement("vllm_cpu")).__module__)
        """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("refused: KV arrangement 'vllm_cpu' is already registered by dlmix.kv.arrangements") == 2
    assert r.stdout.strip().endswith("dlmix.kv.arrangements.vllm_cpu")


@pytest.mark.parametrize("scores, what", [(lambda n: [1.0], "wrong length"), (lambda n: [float("nan")] * n, "NaN")])
def test_policy_whose_score_breaks_the_contract_is_named(scores, what):
    from dlmix.routing.policies import ClusterView, Policy, make_policy, register_policy
    from dlmix.routing.policies.registry import POLICIES
    from dlmix.routing.state import InstanceState, RouteRequest

    @register_policy("test_broken_score")
    class Broken(Policy):
        def score(self, req, cands, view):
            return scores(len(cands))

    try:
        insts = [InstanceState(id=f"i{k}", url=f"http://i{k}:1", chip="H100", slot=k) for k in range(3)]
        # before: IndexError "list index out of range" (wrong length) or always the first instance (NaN)
        with pytest.raises(ValueError, match=r"policy 'test_broken_score': score\(\) must return one number"):
            make_policy("test_broken_score").choose(RouteRequest(prompt_len=10), ClusterView(insts))
    finally:
        POLICIES._classes.pop("test_broken_score", None)


def test_kv_arrangement_with_wrong_views_or_shape_is_named():
    pytest.importorskip("torch")
    from dlmix.kv import KVLayout, ModelIdentity, convert
    from dlmix.kv.ops import allocate
    from dlmix.kv.registry import Arrangement, register, unregister

    class _Base(Arrangement):
        def layer_shape(self, B, N, H, D):
            return (B, N, H, 2 * D)

    class OnePlane(_Base):  # V missing: converted "successfully" before, V never written
        def plane_views(self, cache, N, H, D):
            return (cache[..., :D],)

    class Swapped(_Base):  # [B, H, N, D] views of an NHD cache: a torch size error before
        def plane_views(self, cache, N, H, D):
            return (cache[..., :D].transpose(1, 2), cache[..., D:].transpose(1, 2))

    class Negative(_Base):
        def layer_shape(self, B, N, H, D):
            return (B, -N, H, 2 * D)

    m = ModelIdentity("LlamaForCausalLM", num_layers=2, num_kv_heads=3, head_size=8)
    src = KVLayout(m, block_size=16, dtype="fp32", arrangement="vllm_flash_nhd")
    caches = allocate(src, 4, fill=1.0)
    try:
        for name, cls in (("test_one_plane", OnePlane), ("test_swapped", Swapped)):
            register(name)(cls)
            dst = KVLayout(m, block_size=16, dtype="fp32", arrangement=name)
            with pytest.raises(ValueError, match=rf"arrangement '{name}': plane_views must return 2 view"):
                convert(src, caches, [0, 1], dst, allocate(dst, 4), [0, 1], 20)
        register("test_negative")(Negative)
        with pytest.raises(ValueError, match="'test_negative': layer_shape must be positive integers"):
            allocate(KVLayout(m, block_size=16, dtype="fp32", arrangement="test_negative"), 4)
        assert len(allocate(src, 0)) == 2  # zero blocks stays allowed
    finally:
        for name in ("test_one_plane", "test_swapped", "test_negative"):
            unregister(name)
