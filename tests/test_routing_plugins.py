"""Extension points: a routing policy and a chip added from files outside the package (a temporary distribution with
entry points on sys.path, and a DLMIX_CHIPS folder), used through the simulator and the router's policy factory;
typed policy parameters refuse unknown names with the valid ones."""
import textwrap

import pytest
from typer.testing import CliRunner

from dlmix.hw.cost import CostModel
from dlmix.hw.profiles import CatalogError, load_catalog
from dlmix.routing.policies import (POLICIES, ClusterView, Policy, PolicyParamError, make_policy, register_policy,
                                    split_params)
from dlmix.routing.state import InstanceState, RouteRequest
from dlmix.sim.simulator import Simulator
from dlmix.sim.workload import shared_prefix

CHIP_YAML = """\
chips:
  {name}:
    vendor: Example
    bf16_tflops: {tflops}
    mem_bw_gbps: 2000
    mem_gb: 64
    confidence: low
    source: "test fixture"
"""

POLICY_PY = '''\
"""A third-party policy: send everything to instances of one chip type, least loaded first."""
from typing import Optional

from dlmix.routing.policies import Policy, PolicyParams


class PinChip(Policy):
    class Params(PolicyParams):
        chip: str
        fallback: bool = True

    def filter(self, req, cands, view):
        pinned = [c for c in cands if c.chip == self.params.chip]
        return pinned or (cands if self.params.fallback else [])

    def score(self, req, cands, view):
        return [float(c.load.inflight) for c in cands]
'''


@pytest.fixture
def plugin_dist(tmp_path, monkeypatch):
    """A distribution ``dlmix-testplug`` (package + dist-info with entry points) in a folder put on sys.path."""
    root = tmp_path / "site"
    pkg = root / "dlmix_testplug"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(
        "from pathlib import Path\nCHIPS_YAML = Path(__file__).with_name('chips.yaml')\n")
    (pkg / "policy.py").write_text(POLICY_PY)
    (pkg / "chips.yaml").write_text(CHIP_YAML.format(name="TESTNPU", tflops=300))
    di = root / "dlmix_testplug-0.1.dist-info"
    di.mkdir()
    (di / "METADATA").write_text("Metadata-Version: 2.1\nName: dlmix-testplug\nVersion: 0.1\n")
    (di / "entry_points.txt").write_text(textwrap.dedent("""\
        [dlmix.policies]
        testplug_pin_chip = dlmix_testplug.policy:PinChip

        [dlmix.chips]
        testplug = dlmix_testplug:CHIPS_YAML
        """))
    monkeypatch.syspath_prepend(str(root))
    return root


def _deployment(chip_a, chip_b):
    return {"name": "plug", "block_size": 64, "link": "rdma-100g",
            "instances": [{"chip": chip_a, "count": 1, "role": "both"}, {"chip": chip_b, "count": 1, "role": "both"}]}


def test_policy_and_chip_from_an_installed_distribution(plugin_dist):
    # the chip: found through the dlmix.chips entry point, by the catalog and by the cost model
    cat = load_catalog()
    assert cat.chip("testnpu").bf16_tflops == 300.0
    assert CostModel("llama-3.1-8b", cat).prefill_time("TESTNPU", 1024) > CostModel(
        "llama-3.1-8b", cat).prefill_time("H100", 1024)

    # the policy: found through the dlmix.policies entry point, by the router's factory ...
    assert "testplug_pin_chip" in POLICIES
    pol = make_policy("testplug_pin_chip", chip="TESTNPU")
    assert isinstance(pol, Policy) and pol.name == "testplug_pin_chip"
    insts = [InstanceState(id="h", url="http://h:1", chip="H100", slot=0),
             InstanceState(id="n", url="http://n:1", chip="TESTNPU", slot=1)]
    insts[1].load.inflight = 5  # busier, still chosen: the policy pins the chip
    assert pol.choose(RouteRequest(prompt_len=100), ClusterView(insts)).decode.id == "n"
    with pytest.raises(PolicyParamError, match=r"'chp'.*valid: chip, fallback"):
        make_policy("testplug_pin_chip", chp="TESTNPU")
    with pytest.raises(PolicyParamError, match="chip: Field required"):
        make_policy("testplug_pin_chip")

    # ... and both through the simulator
    reqs = shared_prefix(4, 4, 512, 128, 16, rate=4.0, seed=1)
    res = Simulator(_deployment("H100", "TESTNPU"), "llama-3.1-8b", "testplug_pin_chip",
                    policy_params={"chip": "TESTNPU"}).run(reqs)
    per = res.summary["per_instance"]
    assert res.summary["completed"] == 16
    assert {v["chip"]: v["requests"] for v in per.values()} == {"H100": 0, "TESTNPU": 16}


def test_chip_from_a_dlmix_chips_folder(tmp_path, monkeypatch):
    d = tmp_path / "chips"
    d.mkdir()
    (d / "dirnpu.yaml").write_text(CHIP_YAML.format(name="DIRNPU", tflops=123))
    (d / "notes.txt").write_text("not a chip file")
    monkeypatch.setenv("DLMIX_CHIPS", str(d))
    assert load_catalog().chip("DIRNPU").bf16_tflops == 123.0
    reqs = shared_prefix(2, 4, 512, 128, 16, rate=4.0, seed=2)
    res = Simulator(_deployment("DIRNPU", "DIRNPU"), "llama-3.1-8b", "round_robin").run(reqs)
    assert res.summary["completed"] == 8
    assert {v["chip"] for v in res.summary["per_instance"].values()} == {"DIRNPU"}
    monkeypatch.setenv("DLMIX_CHIPS", str(tmp_path / "missing.yaml"))
    with pytest.raises(CatalogError, match=r"missing.yaml.*DLMIX_CHIPS.*does not exist"):
        load_catalog()


def test_misspelled_policy_param_is_refused_with_the_valid_names():
    with pytest.raises(PolicyParamError) as ei:
        make_policy("cost", itl_targt=0.05)
    msg = str(ei.value)
    assert "'itl_targt'" in msg and "policy 'cost'" in msg
    for name in ("ttft_target", "itl_target", "local_max_uncached", "reject_ttft_factor"):
        assert name in msg
    with pytest.raises(PolicyParamError, match=r"'x'.*valid: \(none"):
        make_policy("round_robin", x=1)
    with pytest.raises(PolicyParamError, match="itl_target: Input should be greater than 0"):
        make_policy("cost", itl_target=0)
    assert make_policy("cost", itl_target="0.1").itl_target == 0.1  # YAML/flag strings coerce
    # a comparison run shares parameters; one no listed policy declares is refused
    assert split_params(["cost", "prefix"], {"itl_target": 0.1, "cache_threshold": 0.5}) == {
        "cost": {"itl_target": 0.1}, "prefix": {"cache_threshold": 0.5}}
    with pytest.raises(PolicyParamError, match=r"'cache_treshold'.*cost: ttft_target.*prefix: cache_threshold"):
        split_params(["cost", "prefix"], {"cache_treshold": 0.5})


def test_misspelled_policy_param_refused_by_router_and_sim_cli():
    from dlmix.router.config import RouterConfig
    from dlmix.router.server import Router

    with pytest.raises(ValueError, match=r"'itl_targt'.*valid: ttft_target, itl_target"):
        Router(RouterConfig(policy="cost", policy_params={"itl_targt": 0.05}))

    from dlmix.cli import app
    r = CliRunner().invoke(app, ["sim", "--deployment", "homog_h100x4", "--workload", "synthetic", "--groups", "2",
                                 "--per-group", "2", "--policy", "cost", "--policy-param", "itl_targt=0.05"])
    assert r.exit_code == 2
    out = r.output + (r.stderr if r.stderr_bytes is not None else "")
    assert "itl_targt" in out and "ttft_target" in out and "itl_target" in out


def test_register_policy_decorator_and_name_clash():
    @register_policy("test_first_instance")
    class First(Policy):
        def score(self, req, cands, view):
            return [float(i) for i in range(len(cands))]

    assert POLICIES["test_first_instance"] is First and First.name == "test_first_instance"
    insts = [InstanceState(id=f"i{k}", url=f"http://h:{k + 1}", slot=k) for k in range(3)]
    assert make_policy("test_first_instance").choose(RouteRequest(), ClusterView(insts)).decode.id == "i0"
    with pytest.raises(ValueError, match="taken by"):
        register_policy("cost")(type("Other", (Policy,), {}))
    with pytest.raises(TypeError, match="not a subclass"):
        register_policy("not_a_policy")(object)
    with pytest.raises(ValueError, match=r"unknown policy 'nope'; choose one of .*cost"):
        make_policy("nope")
