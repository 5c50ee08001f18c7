"""dlmix launch deployment files: every example parses and plans (nothing started); errors name field and line."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dlmix.launch import ConfigError, Deployment, plan

EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "examples").glob("*.yaml"))


def test_examples_exist():
    names = {p.name for p in EXAMPLES}
    assert {"cpu-pd.yaml", "cpu-aggregated.yaml", "gpu-h100-prefill-cpu-decode.yaml", "mixed-chips.yaml"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_parses_and_plans(path, tmp_path):
    dep = Deployment.from_file(path)
    models = {i: (dep.model_of(i) or "") for i in range(len(dep.instances))}  # no model building here
    plans = plan(dep, "s3cret", tmp_path, models=models)
    assert len(plans) == len(dep.instances) + (1 if dep.router_enabled() else 0)
    by_name = {p.name: p for p in plans}
    for i, inst in enumerate(dep.instances):
        p = by_name[dep.instance_name(i)]
        assert p.port == inst.port
        if inst.engine != "vllm":
            continue
        argv = p.argv
        assert argv[argv.index("--port") + 1] == str(inst.port)
        if inst.kv.block_size:
            assert argv[argv.index("--block-size") + 1] == str(inst.kv.block_size)
        if inst.kv.dtype:
            assert argv[argv.index("--dtype") + 1] == inst.kv.dtype
        if inst.role in ("prefill", "decode"):
            ktc = json.loads(argv[argv.index("--kv-transfer-config") + 1])
            assert ktc["kv_connector"] == "DLMixConnector"
            assert ktc["kv_role"] == {"prefill": "kv_producer", "decode": "kv_consumer"}[inst.role]
            extra = ktc["kv_connector_extra_config"]
            assert extra["router_url"] == dep.router.url and extra["shared_secret"] == "s3cret"
            assert extra["public_url"] == inst.url and extra["chip_profile"] == inst.chip
        if inst.device == "cpu" and inst.cpus:
            assert p.env["VLLM_CPU_OMP_THREADS_BIND"] == inst.cpus
        assert p.env.get("DLMIX_VLLM_CPU_AIDS") == ("1" if inst.device == "cpu" else None)
    if dep.router_enabled():
        import yaml

        cfg = yaml.safe_load((tmp_path / "router.yaml").read_text())
        assert cfg["port"] == dep.router.port and cfg["policy"] == dep.router.policy
        assert cfg["admin_key"] == "s3cret"
        assert (tmp_path / "router.yaml").stat().st_mode & 0o077 == 0  # holds the secret


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_no_example_has_a_router_that_refuses_to_start(path):
    """A router bound to a non-loopback host needs client api_keys or allow_open (it refuses to start otherwise);
    examples/lmdeploy-metax-prefill-ppu-decode.yaml had neither."""
    from dlmix.launch.preflight import local_problems

    assert [p for p in local_problems(Deployment.from_file(path)) if p.startswith("router:")] == []


def test_cpu_pd_example_matches_the_issue():
    dep = Deployment.from_file(next(p for p in EXAMPLES if p.name == "cpu-pd.yaml"))
    pre, dec = dep.instances
    assert (pre.role, pre.kv.block_size, pre.kv.dtype, pre.cpus) == ("prefill", 32, "bfloat16", "0")
    assert (dec.role, dec.kv.block_size, dec.kv.dtype, dec.cpus) == ("decode", 128, "float32", "1")
    assert dep.model == "smollm2" and dep.router_enabled()


def _err(text: str) -> str:
    with pytest.raises(ConfigError) as ei:
        Deployment.from_yaml(text, "dep.yaml")
    return str(ei.value)


BASE = "model: tiny-llama\ninstances:\n  - port: 9001\n"


def test_unknown_key_names_field_and_line():
    msg = _err(BASE + "    kv: {block_size: 32, dtpye: float32}\n")
    assert msg == "dep.yaml:4:26: instances[0].kv.dtpye: unknown key; did you mean 'dtype'?"


def test_an_unknown_key_suggests_the_field_it_is_close_to_at_its_own_level():
    """A typo'd key is answered with the closest field of the mapping it sits in (instance, kv, router), as the model
    name check already did; a key close to nothing gets no guess."""
    msg = _err("model: tiny-llama\nrouter: {prot: 9000}\ninstances:\n  - port: 9001\n    tensor_paralel_size: 1\n"
               "    zzz: 1\n")
    assert "router.prot: unknown key; did you mean 'port'?" in msg
    assert "instances[0].tensor_paralel_size: unknown key; did you mean 'tensor_parallel_size'?" in msg
    assert "instances[0].zzz: unknown key\n" in msg + "\n"


def test_wrong_type_and_missing_field_lines():
    msg = _err("model: x\ninstances:\n  - role: prefil\n    port: 9001\n  - role: both\n")
    lines = msg.splitlines()
    assert lines[0] == "dep.yaml:3:11: instances[0].role: Input should be 'prefill', 'decode' or 'both', got 'prefil'"
    assert lines[1] == "dep.yaml:5:5: instances[1].port: required field missing"


def test_cross_field_errors_have_lines():
    msg = _err("model: tiny-llama\nrouter: {port: 9000, policy: nope}\ninstances:\n"
               "  - {role: prefill, port: 9001, kv: {block_size: 48}}\n"
               "  - {role: decode, port: 9001, chip: H999}\n")
    assert "dep.yaml:4:50: instances[0].kv.block_size: vLLM CPU needs a block size that is a multiple of 32" in msg
    assert "dep.yaml:5:26: instances[1].port: port 9001 is also used by instances[0].port" in msg
    assert "dep.yaml:5:38: instances[1].chip: unknown chip 'H999'" in msg
    assert "dep.yaml:2:30: router.policy: unknown policy 'nope'" in msg


def test_pd_without_router_and_duplicates():
    msg = _err("model: m\ninstances:\n  - {role: prefill, port: 9001}\n  - {role: decode, port: 9002}\n")
    assert "router: prefill/decode instances need the router" in msg
    msg = _err("model: m\nmodel: n\ninstances:\n  - {port: 9001}\n")
    assert msg == "dep.yaml:2:1: model: duplicate key (first on line 1)"


def test_yaml_syntax_error_and_empty():
    assert _err("instances:\n  - port: 1\n   bad: [\n").startswith("dep.yaml:3:4: invalid YAML")
    assert "must be a YAML mapping" in _err("")
    assert _err("instances: []\n").startswith("dep.yaml:1:12: instances: List should have at least 1 item")


def test_cli_reports_broken_file_with_line(tmp_path):
    from dlmix.cli import app

    f = tmp_path / "broken.yaml"
    f.write_text(BASE + "    cpus: zero\n")
    res = CliRunner().invoke(app, ["launch", str(f)])
    assert res.exit_code == 2
    assert f"{f}:4:11: instances[0].cpus" in res.output.replace("\n", "")
    ok = tmp_path / "ok.yaml"
    ok.write_text(BASE)
    res = CliRunner().invoke(app, ["launch", str(ok), "--check"])
    assert res.exit_code == 0 and "ok (1 instance(s), router: no)" in res.output.replace("\n", "")


def test_kv_events_use_a_local_ipc_socket_the_router_subscribes_to(tmp_path):
    import yaml

    dep = Deployment.from_yaml(
        "model: m\nrouter: {port: 18000, kv_events: true}\n"
        "instances:\n  - {name: a, role: both, port: 18100, kv: {block_size: 32}}\n", origin="t.yaml")
    plans = plan(dep, "s3cret", tmp_path, models={0: "m"})
    argv = next(p for p in plans if p.name == "a").argv
    ev = json.loads(argv[argv.index("--kv-events-config") + 1])
    assert ev["publisher"] == "zmq" and ev["enable_kv_cache_events"] is True
    # vLLM 0.32's publisher binds ipc:// endpoints (a concrete tcp://host:port would make it connect instead)
    assert ev["endpoint"] == f"ipc://{tmp_path.resolve()}/a-kv-events.ipc"
    cfg = yaml.safe_load((tmp_path / "router.yaml").read_text())
    assert [i["kv_events"] for i in cfg["instances"]] == [ev["endpoint"]]


def test_sglang_pd_plan_builds_sglangs_own_flags_and_registers_the_bootstrap_port(tmp_path):
    import yaml

    dep = Deployment.from_file(next(p for p in EXAMPLES if p.name == "sglang-cpu-pd.yaml"))
    plans = {p.name: p for p in plan(dep, "s3cret", tmp_path, models={0: "/m", 1: "/m"})}
    pre, dec = plans["prefill"].argv, plans["decode"].argv
    for argv, page, dtype, core in ((pre, "16", "bfloat16", "0"), (dec, "64", "float32", "1")):
        if argv[0] == "taskset":  # pinned to its cpus where taskset is installed
            assert argv[1:3] == ["-c", core]
            argv = argv[3:]
        assert argv[0] == ".venv-sglang/bin/python" and argv[1:3] == ["-m", "sglang.launch_server"]
        assert argv[argv.index("--page-size") + 1] == page and argv[argv.index("--dtype") + 1] == dtype
        assert argv[argv.index("--disaggregation-transfer-backend") + 1] == "dlmix"
        assert "--sleep-on-idle" in argv and "--disable-overlap-schedule" in argv
    assert pre[pre.index("--disaggregation-mode") + 1] == "prefill"
    assert dec[dec.index("--disaggregation-mode") + 1] == "decode"
    assert dec[dec.index("--disaggregation-decode-retraction-backup") + 1] == "cpu_tensor"
    bp = int(pre[pre.index("--disaggregation-bootstrap-port") + 1])
    for p in plans.values():
        if p.kind == "engine":
            # the launch's secret is the router's admin key too (its rooms and the prefill's hand-off route)
            assert json.loads(p.env["DLMIX_SGLANG_CONFIG"]) == {"shared_secret": "s3cret", "host": "127.0.0.1",
                                                                "router_admin_key": "s3cret"}
            assert p.env["SGLANG_USE_CPU_ENGINE"] == "1"
    cfg = yaml.safe_load((tmp_path / "router.yaml").read_text())
    assert cfg["admin_key"] == "s3cret"
    regs = {i["id"]: i for i in cfg["instances"]}
    assert regs["prefill"]["engine"] == "sglang" and regs["prefill"]["bootstrap_port"] == bp
    assert "bootstrap_port" not in regs["decode"] and regs["decode"]["block_size"] == 64
    ev = json.loads(pre[pre.index("--kv-events-config") + 1])
    assert ev == {"publisher": "zmq", "endpoint": regs["prefill"]["kv_events"], "bind": True}
    assert ev["endpoint"].startswith("tcp://127.0.0.1:")
    # the router accepts the registrations as launch writes them
    from dlmix.router.config import RouterConfig
    from dlmix.router.server import Router

    r = Router(RouterConfig(**{k: v for k, v in cfg.items() if k in ("instances", "policy")}, port=0))
    assert [i.engine for i in r.instances] == ["sglang", "sglang"]


def test_sglang_config_errors(monkeypatch):
    two = ("model: m\nrouter: {port: 18000}\ninstances:\n"
           "  - {name: p, engine: sglang, role: prefill, port: 18100}\n"
           "  - {name: d, engine: %s, role: decode, port: 18200%s}\n")
    # an SGLang prefill feeds a vLLM decode (its room hand-off), a vLLM prefill an SGLang decode (the router's rooms)
    dep = Deployment.from_yaml(two % ("vllm", ""), "dep.yaml")
    assert [(i.engine, i.role) for i in dep.instances] == [("sglang", "prefill"), ("vllm", "decode")]
    rev = ("model: m\nrouter: {port: 18000}\ninstances:\n"
           "  - {name: p, engine: vllm, role: prefill, port: 18100}\n"
           "  - {name: d, engine: sglang, role: decode, port: 18200}\n")
    dep = Deployment.from_yaml(rev, "dep.yaml")
    assert [(i.engine, i.role) for i in dep.instances] == [("vllm", "prefill"), ("sglang", "decode")]
    from dlmix.router.engines import bridges

    monkeypatch.delitem(bridges.BRIDGES, ("vllm", "sglang"))  # a pair without a bridge is refused with the reason
    assert "PD flows differ" in _err(rev)
    assert "SGLang sizes its KV pool in tokens" in _err(two % ("sglang", ", kv: {cache_bytes: 1048576}"))
    # the vLLM -> SGLang bridge is taken away above: a vLLM prefill is not named
    assert "an SGLang decode instance needs a prefill instance (role: prefill; engine lmdeploy or sglang)" \
        in _err("model: m\nrouter: {port: 18000}\ninstances:\n"
                "  - {engine: sglang, role: decode, port: 18200}\n"
                "  - {engine: sglang, role: both, port: 18300}\n")


ENGINE_ENV = ("model: m\nrouter: {port: 18000}\ninstances:\n"
              "  - {name: p, engine: %s, role: prefill, port: 18100}\n"
              "  - {name: d, engine: %s, role: decode, port: 18200, env: {%s: '%s'}}\n")


def test_an_sglang_instances_own_backend_settings_merge_with_the_launch_secret(tmp_path):
    """Found by a new user setting ``pull_threads`` on an SGLang decode: the instance's own ``DLMIX_SGLANG_CONFIG``
    replaced the whole variable launch writes, so the decode lost the launch's secret and the router's admin key.
    Its keys are now merged over them, as for LMDeploy's ``DLMIX_LMDEPLOY_CONFIG``."""
    dep = Deployment.from_yaml(ENGINE_ENV % ("sglang", "sglang", "DLMIX_SGLANG_CONFIG", '{"pull_threads": 2}'),
                               "dep.yaml")
    plans = {p.name: p for p in plan(dep, "s3cret", tmp_path, models={0: "/m", 1: "/m"})}
    assert json.loads(plans["d"].env["DLMIX_SGLANG_CONFIG"]) == {
        "shared_secret": "s3cret", "host": "127.0.0.1", "router_admin_key": "s3cret", "pull_threads": 2}
    assert "pull_threads" not in json.loads(plans["p"].env["DLMIX_SGLANG_CONFIG"])


@pytest.mark.parametrize("engine, var", [("sglang", "DLMIX_SGLANG_CONFIG"), ("lmdeploy", "DLMIX_LMDEPLOY_CONFIG")])
@pytest.mark.parametrize("value", ["0", "65", '"4"', "true", "-1"])
def test_a_bad_pull_threads_in_an_engines_backend_settings_is_refused_by_the_check(engine, var, value):
    """Found by a new user: ``pull_threads`` (or any key) in an SGLang or LMDeploy instance's ``env`` passed
    ``--check`` and the launch, and only the engine refused it at start-up, a minute later (for SGLang, with the
    launch's secret lost, see above). The file check now runs the backend's own validation and names the field."""
    msg = _err(ENGINE_ENV % (engine, engine, var, '{"pull_threads": %s}' % value))
    assert f"instances[1].env.{var}: invalid {var}:" in msg and "pull_threads:" in msg, msg
    assert "not valid JSON" in _err(ENGINE_ENV % (engine, engine, var, "{pull_threads: 4"))
    Deployment.from_yaml(ENGINE_ENV % (engine, engine, var, '{"pull_threads": 64}'), "dep.yaml")


def test_lmdeploy_pd_plan_builds_lmdeploys_own_command_and_the_engines_register_themselves(tmp_path):
    import yaml

    dep = Deployment.from_file(next(p for p in EXAMPLES if p.name == "lmdeploy-cpu-pd.yaml"))
    plans = {p.name: p for p in plan(dep, "s3cret", tmp_path, models={0: "/m", 1: "/m"})}
    for name, role, block, dtype, core in (("prefill", "Prefill", "16", "bfloat16", "0"),
                                           ("decode", "Decode", "64", "float16", "1")):
        argv = plans[name].argv
        if argv[0] == "taskset":
            assert argv[1:3] == ["-c", core]
            argv = argv[3:]
        assert argv[:4] == [".venv-lmdeploy/bin/lmdeploy", "serve", "api_server", "/m"]
        assert argv[argv.index("--role") + 1] == role and argv[argv.index("--migration-backend") + 1] == "DLMix"
        assert argv[argv.index("--cache-block-seq-len") + 1] == block and argv[argv.index("--dtype") + 1] == dtype
        assert argv[argv.index("--num-gpu-blocks") + 1] == "256" and "--eager-mode" in argv
        # not LMDeploy's --proxy-url (it cannot send the router's admin key): the engine's own hook registers it
        assert "--proxy-url" not in argv and plans[name].self_registers
        env = plans[name].env
        port = {"prefill": 8100, "decode": 8200}[name]
        assert json.loads(env["DLMIX_LMDEPLOY_CONFIG"]) == {
            "shared_secret": "s3cret", "host": "127.0.0.1", "router_url": "http://127.0.0.1:8000",
            "router_admin_key": "s3cret", "public_url": f"http://127.0.0.1:{port}", "instance_id": name,
            "model_name": "smollm2",
            "chip_profile": "cpu-x86"}
        assert env["DLMIX_LMDEPLOY_CPU"] == "1" and env["OMP_NUM_THREADS"] == "1"
        assert plans[name].health_path == "/health"
    cfg = yaml.safe_load((tmp_path / "router.yaml").read_text())
    assert cfg["instances"] == [] and cfg["admin_key"] == "s3cret"  # nothing registered statically


def test_lmdeploy_instance_settings_merge_with_the_launch_secret(tmp_path):
    dep = Deployment.from_file(next(p for p in EXAMPLES if p.name == "lmdeploy-metax-prefill-ppu-decode.yaml"))
    plans = {p.name: p for p in plan(dep, "s3cret", tmp_path, models={0: "/m", 1: "/m"})}
    got = json.loads(plans["prefill-metax"].env["DLMIX_LMDEPLOY_CONFIG"])
    assert {k: got[k] for k in ("shared_secret", "host", "transport")} == {
        "shared_secret": "s3cret", "host": "10.0.0.11", "transport": "dlslime"}
    argv = plans["decode-ppu"].argv
    assert argv[argv.index("--device") + 1] == "cuda" and "--eager-mode" not in argv
    assert plans["prefill-metax"].argv[plans["prefill-metax"].argv.index("--device") + 1] == "maca"


@pytest.mark.parametrize("router_host, instance_host, router_url, public_url", [
    ("0.0.0.0", "0.0.0.0", "http://127.0.0.1:8000", "http://127.0.0.1:8100"),
    ("::", "::", "http://[::1]:8000", "http://[::1]:8100"),
    ("::1", "fe80::1", "http://[::1]:8000", "http://[fe80::1]:8100"),
    ("127.0.0.1", "10.0.0.11", "http://127.0.0.1:8000", "http://10.0.0.11:8100"),
])
def test_wildcard_and_ipv6_binds_give_urls_that_reach_them(tmp_path, router_host, instance_host, router_url,
                                                            public_url):
    """An engine registers at the router's URL and announces its own: a wildcard bind address is no address to
    connect to (loopback instead: everything a launch starts runs on this machine), and an IPv6 literal needs
    brackets in a URL (``http://:::8000`` is not one)."""
    dep = Deployment.from_file(next(p for p in EXAMPLES if p.name == "lmdeploy-cpu-pd.yaml"))
    dep.router.host = router_host
    dep.instances[0].host = instance_host
    plans = {p.name: p for p in plan(dep, "s3cret", tmp_path, models={0: "/m", 1: "/m"})}
    got = json.loads(plans["prefill"].env["DLMIX_LMDEPLOY_CONFIG"])
    assert (got["router_url"], got["public_url"], got["host"]) == (router_url, public_url, instance_host)
    argv = plans["prefill"].argv
    assert argv[argv.index("--server-name") + 1] == instance_host  # still binds what the file says
    assert dep.entry_url() == router_url and plans["prefill"].url == public_url


def test_lmdeploy_config_errors(monkeypatch):
    two = ("model: m\nrouter: {port: 18000}\ninstances:\n"
           "  - {name: p, engine: lmdeploy, role: prefill, port: 18100}\n"
           "  - {name: d, engine: %s, role: decode, port: 18200%s}\n")
    # bridges join LMDeploy and vLLM both ways, and LMDeploy into an SGLang decode
    assert Deployment.from_yaml(two % ("vllm", ""), "dep.yaml").instances[1].engine == "vllm"
    vp = two.replace("engine: lmdeploy, role: prefill", "engine: vllm, role: prefill")
    assert Deployment.from_yaml(vp % ("lmdeploy", ""), "dep.yaml").instances[1].engine == "lmdeploy"
    assert Deployment.from_yaml(two % ("sglang", ""), "dep.yaml").instances[1].engine == "sglang"
    from dlmix.router.engines import bridges

    monkeypatch.delitem(bridges.BRIDGES, ("lmdeploy", "sglang"))
    err = _err(two % ("sglang", ""))
    assert "a lmdeploy prefill cannot feed a sglang decode" in err and "PD flows differ" in err
    assert "bridges: lmdeploy -> vllm, sglang -> lmdeploy" in err and "lmdeploy -> sglang" not in err
    assert "LMDeploy's KV dtype follows --dtype" in _err(two % ("lmdeploy", ", kv: {cache_dtype: fp8}"))
    assert "DLMix migration backend" in _err(two % ("lmdeploy", ", connector: {name: X}"))
    assert "an LMDeploy decode instance needs a prefill instance (role: prefill; engine lmdeploy or sglang or vllm)" \
        in _err("model: m\nrouter: {port: 18000}\ninstances:\n"
                "  - {engine: lmdeploy, role: decode, port: 18200}\n"
                "  - {engine: lmdeploy, role: both, port: 18300}\n")


def test_launched_lmdeploy_engines_register_themselves_and_publish_kv_events(tmp_path):
    """Under ``dlmix launch`` every LMDeploy instance, any role, registers itself with the launched router through
    its admin API (its name as id, the launch's secret as key) and heartbeats its own load; one with
    ``--enable-prefix-caching`` behind a router with ``kv_events`` also publishes its prefix cache on a TCP port of
    its host. A Hybrid instance gets only the router keys (no migration backend settings)."""
    dep = Deployment.from_yaml("model: m\nrouter: {port: 18000, kv_events: true}\ninstances:\n"
                               "  - {name: a, engine: lmdeploy, role: both, port: 18100, chip: cpu-x86,\n"
                               "     extra_args: [--enable-prefix-caching]}\n"
                               "  - {name: b, engine: lmdeploy, role: both, port: 18200}\n", "dep.yaml")
    plans = {p.name: p for p in plan(dep, "s3cret", tmp_path, models={0: "/m", 1: "/m"})}
    a = json.loads(plans["a"].env["DLMIX_LMDEPLOY_CONFIG"])
    ev = a.pop("kv_events_endpoint")
    assert a == {"router_url": "http://127.0.0.1:18000", "router_admin_key": "s3cret", "instance_id": "a",
                 "public_url": "http://127.0.0.1:18100", "model_name": "m", "chip_profile": "cpu-x86"}
    assert ev.startswith("tcp://127.0.0.1:") and int(ev.rsplit(":", 1)[1]) not in (18000, 18100, 18200)
    b = json.loads(plans["b"].env["DLMIX_LMDEPLOY_CONFIG"])
    assert "kv_events_endpoint" not in b and b["instance_id"] == "b"
    assert "--migration-backend" not in plans["a"].argv and plans["a"].self_registers and plans["b"].self_registers


def test_check_and_launch_refuse_what_this_machine_lacks(tmp_path, monkeypatch):
    """A valid file naming a model folder that does not exist, a core this process may not run on and a missing
    interpreter: ``--check`` exits 2 listing each problem with its instance; a launch exits 1 with the same lines and
    "Nothing was started." (not the stopped-processes line, nothing ran); ``--dry-run`` prints the command lines,
    the problems as notes, exits 0 and leaves no temporary folder behind. A mock engine's model is never checked."""
    import os
    import tempfile

    from dlmix.cli import app
    from dlmix.launch.preflight import available_cpus

    beyond = max(available_cpus()) + 1
    f = tmp_path / "dep.yaml"
    f.write_text(f"model: {tmp_path}/no-such-model\ninstances:\n"
                 f"  - {{port: 9001, cpus: '{beyond}'}}\n"
                 f"  - {{port: 9002, python: {tmp_path}/venv/bin/python}}\n"
                 f"  - {{port: 9003, engine: mock}}\n")
    want = [f"instances[0] (both-0): model '{tmp_path}/no-such-model' does not exist on this machine",
            f"instances[0] (both-0): cpus '{beyond}' names core(s) {beyond} that this machine does not offer",
            f"instances[1] (both-1): model '{tmp_path}/no-such-model' does not exist on this machine",
            f"instances[1] (both-1): python '{tmp_path}/venv/bin/python' does not exist on this machine"]
    res = CliRunner().invoke(app, ["launch", str(f), "--check"])
    lines = [ln.strip() for ln in res.output.splitlines()]
    assert res.exit_code == 2, res.output
    assert lines[0] == f"{f}: valid, but it cannot start on this machine"
    assert [ln.split(" (a local folder")[0].split(" (available")[0] for ln in lines[1:]] == \
        [w if "cpus" not in w else w + " to this process" for w in want]
    assert "instances[2]" not in res.output  # engine: mock loads no model
    res = CliRunner().invoke(app, ["launch", str(f), "--log-dir", str(tmp_path / "logs")])
    assert res.exit_code == 1, res.output
    assert "cannot start on this machine" in res.output and res.output.rstrip().endswith("Nothing was started.")
    assert "Every process that was started" not in res.output and not (tmp_path / "logs").exists()
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    res = CliRunner().invoke(app, ["launch", str(f), "--dry-run"])
    assert res.exit_code == 0, res.output
    assert res.output.count("note: instances[") == 4 and "--port 9001" in res.output
    assert os.listdir(scratch) == []


def test_check_names_a_likely_typo_of_a_dlmix_model_name(tmp_path):
    """A bare model name close to a dlmix model name (not 'org/name', no folder of that name) is reported by --check
    before anything starts; a hub id, a real dlmix name and an unrelated bare name are not."""
    from dlmix.cli import app
    from dlmix.launch.preflight import local_problems

    f = tmp_path / "dep.yaml"
    f.write_text("instances:\n  - {port: 9001, model: smolm2}\n  - {port: 9002, model: tiny-lama}\n"
                 "  - {port: 9003, model: smollm2}\n  - {port: 9004, model: HuggingFaceTB/smolm2}\n"
                 "  - {port: 9005, model: gpt2}\n  - {port: 9006, engine: mock, model: smolm2}\n")
    problems = local_problems(Deployment.from_file(f))
    assert [p.split(";")[0] for p in problems] == [
        "instances[0] (both-0): model 'smolm2' is neither a dlmix model name nor a folder here",
        "instances[1] (both-1): model 'tiny-lama' is neither a dlmix model name nor a folder here"]
    assert "did you mean 'smollm2'?" in problems[0] and "did you mean 'tiny-llama'?" in problems[1]
    res = CliRunner().invoke(app, ["launch", str(f), "--check"])
    assert res.exit_code == 2 and "did you mean 'smollm2'?" in res.output, res.output

def test_check_refuses_a_model_folder_without_config_json(tmp_path, tiny_model_dir):
    """A model folder that exists but holds no config.json (e.g. the parent of the model folder) is reported by
    --check with its instance (exit code 2) instead of passing and failing in the engine's traceback after start-up;
    the real folder, a Mistral-style folder (params.json) and a mock engine are not reported."""
    from dlmix.cli import app
    from dlmix.launch.preflight import local_problems

    empty = tmp_path / "models"
    empty.mkdir()
    mistral = tmp_path / "mistral"
    mistral.mkdir()
    (mistral / "params.json").write_text("{}")
    f = tmp_path / "dep.yaml"
    f.write_text(f"instances:\n  - {{port: 9001, model: {empty}}}\n  - {{port: 9002, model: {tiny_model_dir}}}\n"
                 f"  - {{port: 9003, model: {mistral}}}\n  - {{port: 9004, engine: mock, model: {empty}}}\n")
    problems = local_problems(Deployment.from_file(f))
    assert [p.split(":")[0] for p in problems] == ["instances[0] (both-0)"]
    assert f"model folder '{empty}' holds no config.json" in problems[0]
    res = CliRunner().invoke(app, ["launch", str(f), "--check"])
    assert res.exit_code == 2 and "holds no config.json" in res.output, res.output


def test_check_refuses_a_tp_size_or_context_the_model_cannot_run(tmp_path, smollm2_dir, tiny_model_dir):
    """vLLM/SGLang instances whose tensor_parallel_size the model's head counts do not allow (SmolLM2: 9 heads, 3 KV
    heads -> 1, 3, 9; the tiny Llama: 4 heads, 2 KV heads -> 1, 2, 4) or whose max_model_len exceeds the model's
    config.json limit are refused with their line, exit code 2, for a dlmix model name and a local folder; the
    engine's override variable lifts the length check; LMDeploy, mock and hub-id instances are not checked."""
    import shutil

    from dlmix.cli import app

    folder = tmp_path / "tiny"
    folder.mkdir()
    shutil.copy(tiny_model_dir / "config.json", folder / "config.json")
    f = tmp_path / "dep.yaml"
    f.write_text(
        "model: smollm2\n"
        "instances:\n"
        "  - {name: a, port: 9001, device: cuda, chip: H100, devices: '0,1,2,3', tensor_parallel_size: 4,\n"
        "     max_model_len: 131072}\n"
        "  - {name: b, port: 9002, tensor_parallel_size: 3, max_model_len: 8192}\n"
        f"  - {{name: c, port: 9003, engine: sglang, model: {folder}, tensor_parallel_size: 3}}\n"
        f"  - {{name: d, port: 9004, model: {folder}, tensor_parallel_size: 4, max_model_len: 8192,\n"
        "     env: {VLLM_ALLOW_LONG_MAX_MODEL_LEN: '1'}}\n"
        "  - {name: e, port: 9005, engine: lmdeploy, tensor_parallel_size: 2, max_model_len: 131072}\n"
        "  - {name: f, port: 9006, engine: mock, tensor_parallel_size: 2}\n"
        "  - {name: g, port: 9007, model: org/not-local, tensor_parallel_size: 2, max_model_len: 131072}\n")
    res = CliRunner().invoke(app, ["launch", str(f), "--check"])
    assert res.exit_code == 2, res.output
    lines = [ln.strip() for ln in res.output.splitlines() if ln.strip()]
    row6 = f.read_text().splitlines()[5]
    col6 = row6.index("tensor_parallel_size: 3") + len("tensor_parallel_size: ") + 1  # the value's column
    assert lines == [
        "error in deployment file",
        f"{f}:3:95: instances[0].tensor_parallel_size: instance 'a' (vllm, model smollm2): tensor_parallel_size 4 "
        "does not fit the model's 9 attention heads and 3 KV heads; allowed sizes: 1, 3, 9 (the heads must divide "
        "by TP, and the KV heads by TP, or TP by the KV heads when TP is larger)",
        f"{f}:4:21: instances[0].max_model_len: instance 'a' (vllm, model smollm2): max_model_len 131072 exceeds "
        "the model's context limit of 8192 tokens (max_position_embeddings of its config.json); the engine refuses "
        "it (set VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 in env to force it, at the risk of wrong outputs)",
        f"{f}:6:{col6}: instances[2].tensor_parallel_size: instance 'c' (sglang, model {folder}): "
        "tensor_parallel_size 3 does not fit the model's 4 attention heads and 2 KV heads; allowed sizes: 1, 2, 4 (the heads must divide "
        "by TP, and the KV heads by TP, or TP by the KV heads when TP is larger)"], res.output
    # the same file with sizes the heads allow and lengths within the limits passes
    text = f.read_text().replace("tensor_parallel_size: 4,\n     max_model_len: 131072",
                                 "tensor_parallel_size: 9,\n     max_model_len: 8192")
    f.write_text(text.replace("tensor_parallel_size: 3}", "tensor_parallel_size: 2}"))
    res = CliRunner().invoke(app, ["launch", str(f), "--check"])
    assert res.exit_code == 0 and ": ok (7 instance(s)" in res.output, res.output


@pytest.mark.parametrize("extra, needle", [
    ("    name: router\n", "instances[0].name: instance name 'router' cannot be used"),
    ("    name: a/b\n", "instances[0].name: instance name 'a/b' cannot be used"),
    ("    name: '..'\n", "instances[0].name: instance name '..' cannot be used"),
    ("    tensor_parallel_size: 100000\n",
     "instances[0].tensor_parallel_size: Input should be less than or equal to 1024"),
    ("    cpus: 0-2000000000\n", "larger than 65535"),
    ("    ready_timeout_s: .inf\n", "instances[0].ready_timeout_s: Input should be a finite number"),
    ("    restart: {backoff_s: .nan}\n", "instances[0].restart.backoff_s: Input should be a finite number"),
])
def test_names_and_numbers_a_launch_cannot_use_are_refused_by_the_check(extra, needle):
    """Found by trying them: an instance named ``router`` (the router's own log file and supervision entry: killing
    the router then spawned two), a name with ``/`` or ``..`` (its log file outside LOG_DIR, or a start failure
    after ``--check`` said ok), a TP size of 100,000 (a traceback from the port search), a core list of two billion
    ids (built in memory) and an infinite readiness wait or NaN back-off are ConfigErrors naming the field."""
    assert needle in _err(BASE + extra)


@pytest.mark.parametrize("args", ["[--disaggregation-bootstrap-port]", "[--disaggregation-bootstrap-port, x]",
                                  "[--disaggregation-bootstrap-port, '18000']"])
def test_an_sglang_bootstrap_port_that_cannot_work_is_refused_by_the_check(args):
    """SGLang's ``--disaggregation-bootstrap-port`` in ``extra_args`` without a port number, or on a port the router
    uses: a ConfigError (was a traceback at ``--dry-run`` and a bare IndexError at launch)."""
    msg = _err("model: m\nrouter: {port: 18000}\ninstances:\n"
               f"  - {{name: p, engine: sglang, role: prefill, port: 18100, extra_args: {args}}}\n"
               "  - {name: d, engine: sglang, role: decode, port: 18200}\n")
    assert "--disaggregation-bootstrap-port" in msg


def test_a_file_that_is_not_utf8_or_expands_exponentially_is_an_error_not_a_hang(tmp_path):
    """A deployment file that is not UTF-8 is a ConfigError (was a UnicodeDecodeError traceback); a few hundred bytes
    of nested YAML aliases are checked at once (locating fields walked every expanded path: over a minute, millions
    of entries)."""
    import time

    f = tmp_path / "latin1.yaml"
    f.write_bytes(BASE.encode() + b"    name: caf\xe9\n")
    with pytest.raises(ConfigError, match="cannot read deployment file"):
        Deployment.from_file(f)
    bomb = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n"
        for p, c in zip("abcdefgh", "bcdefghi")) + BASE
    t = time.monotonic()
    with pytest.raises(ConfigError, match="unknown key"):
        Deployment.from_yaml(bomb, "bomb.yaml")
    assert time.monotonic() - t < 30  # generous: it takes milliseconds; the unfixed walk never ended


ROUTED = ("model: tiny-llama\nrouter: {port: 9000%s}\ninstances:\n"
          "  - {role: prefill, port: 9001%s}\n  - {role: decode, port: 9002}\n")


@pytest.mark.parametrize("router, inst, needle", [
    (", config: {health_interval: 2}", "", "router.config: unknown router config key(s): health_interval"),
    (", policy: prefix, policy_params: {min_hit: 3}", "", "router.policy_params:"),
    (", policy: oracle", "", "router.policy: policy 'oracle' runs only in the simulator (dlmix sim)"),
    ("", ", connector: {extra_config: {transport: tpc}}", "instances[0].connector.extra_config: invalid DLMixConnector"),
])
def test_what_the_router_or_the_connector_refuses_at_start_is_refused_by_the_check(router, inst, needle):
    """Found by a new user: a router config key or policy parameter misspelled, a simulator-only policy, or a typo in
    the connector's settings passed ``--check`` and failed only when the router (exit 2) or vLLM (a minute in)
    started. Each is now a ConfigError naming the field."""
    import dlmix.sim  # noqa: F401  (registers the simulator-only oracle, as the dlmix CLI does)

    msg = _err(ROUTED % (router, inst))
    assert needle in msg, msg
    msg = _err(ROUTED % (", policy: nope", ""))  # the policies listed are those a router can run
    assert "router.policy: unknown policy 'nope'; choose one of cost," in msg and "oracle" not in msg, msg
    Deployment.from_yaml(ROUTED % ("", ""), "dep.yaml")  # the same file without the mistake is fine


def test_the_check_validates_the_policy_the_router_runs_when_router_config_names_one():
    """``router.config`` keys win over ``router.policy``/``policy_params`` in the router.yaml a launch writes: the check
    validates those. Before, a simulator-only or misspelt policy under ``router.config`` passed ``--check`` (the router
    then refused to start), and parameters valid for the config's policy were refused as the other policy's."""
    import dlmix.sim  # noqa: F401  (registers the simulator-only oracle, as the dlmix CLI does)

    for router, needle in ((", config: {policy: oracle}", "router.config.policy: policy 'oracle' runs only"),
                           (", config: {policy: nope}", "router.config.policy: unknown policy 'nope'"),
                           (", config: {policy_params: {min_hit: 3}}", "router.config.policy_params: unknown "
                                                                       "parameter 'min_hit' for policy 'prefix'")):
        msg = _err(ROUTED % (router, ""))
        assert needle in msg, msg
    Deployment.from_yaml(ROUTED % (", policy: round_robin, policy_params: {cache_threshold: 0.5}, "
                                   "config: {policy: prefix}", ""), "dep.yaml")


def test_a_router_open_to_the_network_without_client_keys_is_a_machine_problem():
    """The router refuses to serve a non-loopback ``host`` without ``api_keys`` or ``allow_open``; ``--check`` and a
    launch now say so before anything starts (before: ``--check`` said ok and the launch failed)."""
    from dlmix.launch.preflight import local_problems

    text = ROUTED % (", host: 0.0.0.0", "", )
    (p,) = [x for x in local_problems(Deployment.from_yaml(text, "dep.yaml")) if x.startswith("router:")]
    assert "host '0.0.0.0' is not loopback and router.config sets no api_keys" in p
    for ok in (", host: 0.0.0.0, config: {api_keys: [k]}", ", host: 0.0.0.0, config: {allow_open: true}", ""):
        assert not [x for x in local_problems(Deployment.from_yaml(ROUTED % (ok, ""), "dep.yaml"))
                    if x.startswith("router:")], ok


def test_the_open_router_check_reads_router_config_as_the_router_does():
    """The router reads router.config's keys as RouterConfig does (``api-keys`` for ``api_keys``, ``"false"`` a false
    bool, ``host`` over router.host). Before, a launch refused a router with ``api-keys`` set ("Nothing was started")
    and let through one the router then refused (``host`` under router.config, ``allow_open: "false"``)."""
    from dlmix.launch.preflight import local_problems

    def flagged(router):
        return [x for x in local_problems(Deployment.from_yaml(ROUTED % (router, ""), "dep.yaml"))
                if x.startswith("router:")]

    assert not flagged(", host: 0.0.0.0, config: {api-keys: [k]}")
    assert not flagged(", host: 0.0.0.0, config: {allow-open: true}")
    assert flagged(", config: {host: 0.0.0.0}")
    assert flagged(", host: 0.0.0.0, config: {allow_open: 'false'}")


def test_flags_that_cannot_go_together_or_a_log_dir_that_is_a_file_are_refused(tmp_path):
    """Found by a new user: ``--emit k8s DIR --dry-run`` wrote the manifests anyway, ``--grace -5`` was taken, and
    ``--log-dir`` naming a file ended in a raw FileExistsError. Each is exit 2 with the reason, nothing written."""
    from dlmix.cli import app

    f = tmp_path / "dep.yaml"
    f.write_text(BASE.replace("tiny-llama", "m") + "    engine: mock\n")
    out = tmp_path / "k8s"
    res = CliRunner().invoke(app, ["launch", str(f), "--emit", "k8s", str(out), "--dry-run"])
    assert res.exit_code == 2 and "--check, --dry-run and --emit are alternatives" in res.output, res.output
    assert not out.exists()
    res = CliRunner().invoke(app, ["launch", str(f), "--grace", "-5"])
    assert res.exit_code == 2 and "--grace" in res.output, res.output
    (tmp_path / "afile").write_text("x")
    res = CliRunner().invoke(app, ["launch", str(f), "--log-dir", str(tmp_path / "afile")])
    assert res.exit_code == 2 and "exists and is not a folder" in res.output, res.output


def test_dry_run_shows_the_model_folder_a_launch_passes(tmp_path, smollm2_dir, monkeypatch):
    """``--dry-run`` printed ``--model smollm2`` (the dlmix name), which vLLM cannot load: it now shows the folder
    a launch builds and passes, or says the model is not built yet."""
    from dlmix.cli import app

    f = tmp_path / "dep.yaml"
    f.write_text("model: smollm2\ninstances:\n  - {port: 9001, cpus: '0'}\n")
    res = CliRunner().invoke(app, ["launch", str(f), "--dry-run"])
    assert res.exit_code == 0 and f"--model {smollm2_dir} " in res.output, res.output
    monkeypatch.setenv("DLMIX_CACHE", str(tmp_path / "empty-cache"))
    res = CliRunner().invoke(app, ["launch", str(f), "--dry-run"])
    assert res.exit_code == 0 and "--model smollm2 " in res.output, res.output
    assert "note: model 'smollm2' is not built yet: a launch builds it" in " ".join(res.output.split()), res.output


def test_decode_only_deployment_names_the_decode_engine_and_its_feeders():
    """A deployment with an SGLang decode and no prefill instance (a user who dropped the prefill of
    examples/cpu-vllm-prefill-sglang-decode.yaml): one message, naming the decode's own engine and every engine whose
    prefill can feed it (a vLLM prefill feeds an SGLang decode through the router's rooms), not "needs an SGLang
    prefill", and not named after another instance's engine (a vLLM ``both`` instance next to it)."""
    err = _err("model: m\nrouter: {port: 18000}\ninstances:\n"
               "  - {name: d, engine: sglang, role: decode, port: 18200}\n")
    lines = [x for x in err.splitlines() if "prefill" in x]
    assert len(lines) == 1, err
    assert "an SGLang decode instance needs a prefill instance (role: prefill; engine lmdeploy or sglang or vllm)" \
        in lines[0], err
    err = _err("model: m\nrouter: {port: 18000}\ninstances:\n"
               "  - {name: b, engine: lmdeploy, role: both, port: 18100}\n"
               "  - {name: d, engine: sglang, role: decode, port: 18200}\n")
    assert "an SGLang decode instance needs a prefill instance" in err and "LMDeploy decode" not in err, err


def test_check_names_the_directory_a_relative_python_is_taken_from(tmp_path, monkeypatch):
    """The examples name their engine's venv relatively (``python: .venv-lmdeploy/bin/python``); run from another
    directory, ``--check`` says which directory the path was taken from and what to do, not only that it does not
    exist."""
    from dlmix.cli import app

    f = tmp_path / "dep.yaml"
    f.write_text("model: m\ninstances:\n  - {port: 9001, engine: mock, python: .venv-x/bin/python}\n")
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(app, ["launch", str(f), "--check"])
    assert res.exit_code == 2, res.output
    out = " ".join(res.output.split())
    assert (f"python '.venv-x/bin/python' does not exist on this machine (a relative path is taken from the "
            f"directory dlmix launch runs in, {tmp_path}: run it where .venv-x/bin/python exists") in out, res.output
