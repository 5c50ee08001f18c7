"""``dlmix launch FILE --emit k8s DIR``: the generated objects are validated against the Kubernetes API schema with
the official client's models (required fields and types through ``from_dict``; no unknown field: the model
serialises back to exactly the same object), and checked for what a cluster would only reveal at run time
(selectors, ``$(VAR)`` references, probe ports, device resources and node selectors per chip vendor)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

kubernetes = pytest.importorskip("kubernetes")
from kubernetes.client import ApiClient  # noqa: E402

from dlmix.hw.profiles import load_catalog  # noqa: E402
from dlmix.launch import Deployment  # noqa: E402
from dlmix.launch.config import ConfigError  # noqa: E402
from dlmix.launch.k8s import SIDE_CHANNEL_PORT, build_manifests, emit_k8s  # noqa: E402
from dlmix.router.config import RouterConfig  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DNS1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def _validate(obj: dict):
    """Deserialize into the client's model of its kind (raises on a missing required field or a wrong type) and
    require the model to serialise back to the same object (an unknown or misspelt field would be dropped)."""
    api = ApiClient()
    assert obj["apiVersion"] in ("v1", "apps/v1", "networking.k8s.io/v1")
    model = getattr(kubernetes.client, "V1" + obj["kind"]).from_dict(obj)
    assert api.sanitize_for_serialization(model) == obj
    name = obj["metadata"]["name"]
    assert DNS1123.match(name) and len(name) <= 63, name
    for k, v in obj["metadata"].get("labels", {}).items():
        assert LABEL_VALUE.match(v) and len(v) <= 63, (k, v)
    return model


def _containers(obj):
    return obj["spec"]["template"]["spec"]["containers"]


def _check_workload(obj: dict) -> None:
    spec = obj["spec"]
    tmpl_labels = spec["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= tmpl_labels.items()      # the selector selects the pods
    for c in _containers(obj):
        defined = [e["name"] for e in c.get("env", [])]
        for text in c.get("command", []) + c.get("args", []):
            for ref in VAR_REF.findall(text):
                assert ref in defined, (obj["metadata"]["name"], ref)
        ports = {p["containerPort"] for p in c["ports"]}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            if probe in c:
                p = c[probe]
                port = (p.get("httpGet") or p.get("tcpSocket"))["port"]
                assert port in ports
                if "httpGet" in p:
                    assert p["httpGet"]["path"] == "/health"


def _by(objs, kind):
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == kind}


def test_mixed_chips_manifests_pass_schema_validation(tmp_path):
    dep = Deployment.from_file(ROOT / "examples/mixed-chips.yaml")
    m = emit_k8s(dep, tmp_path / "k8s", secret="s3cret")
    files = sorted((tmp_path / "k8s").iterdir())
    assert [f.name for f in files] == sorted(m.files) and len(files) == 14
    objs = [yaml.safe_load(f.read_text()) for f in files]
    assert objs == [m.objects[m.files.index(f.name)] for f in files]
    for o in objs:
        _validate(o)
    assert {o["kind"] for o in objs} == {"Secret", "ConfigMap", "Deployment", "Service", "NetworkPolicy"}
    assert (os.stat(tmp_path / "k8s" / m.files[0]).st_mode & 0o777) == 0o600      # the Secret
    deps, svcs = _by(objs, "Deployment"), _by(objs, "Service")
    assert set(deps) == {"mixed-chips-router", "mixed-chips-prefill-h100", "mixed-chips-decode-h20",
                         "mixed-chips-decode-ascend", "mixed-chips-etcd"}
    for d in deps.values():
        _check_workload(d)
    # one workload per instance group: vendor device resource and node selector per chip, from the chip catalog
    want = {"mixed-chips-prefill-h100": ("nvidia.com/gpu", "H100"), "mixed-chips-decode-h20": ("nvidia.com/gpu", "H20"),
            "mixed-chips-decode-ascend": ("huawei.com/Ascend910", "Ascend910B")}
    for name, (res, chip) in want.items():
        pod = deps[name]["spec"]["template"]["spec"]
        c = pod["containers"][0]
        assert c["resources"]["limits"] == {res: "1"}
        assert pod["nodeSelector"] == {"dlmix.io/chip": chip}
        assert deps[name]["spec"]["replicas"] == 1
        assert c["command"] == ["python3"] and c["args"][:2] == ["-m", "vllm.entrypoints.openai.api_server"]
        assert c["args"][c["args"].index("--host") + 1] == "$(POD_IP)"
        kvt = yaml.safe_load(c["args"][c["args"].index("--kv-transfer-config") + 1])
        extra = kvt["kv_connector_extra_config"]
        assert extra["router_url"] == "http://mixed-chips-router-admin:8000"
        assert extra["public_url"].startswith("http://$(POD_IP):") and extra["port"] == SIDE_CHANNEL_PORT
        assert extra["shared_secret"] == extra["router_admin_key"] == "$(DLMIX_SECRET)"
        assert not {e["name"] for e in c["env"]} & {"CUDA_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES"}
        assert {"startupProbe", "readinessProbe", "livenessProbe"} <= set(c)
        assert c["startupProbe"]["failureThreshold"] * c["startupProbe"]["periodSeconds"] >= 600
        assert svcs[name]["spec"]["selector"] == deps[name]["spec"]["selector"]["matchLabels"]
    # router: replicated Deployment with client and admin Services, config from the ConfigMap, key from the Secret
    r = deps["mixed-chips-router"]
    rc = _containers(r)[0]
    assert rc["args"] == ["--config", "/etc/dlmix/router.yaml", "--admin-key", "$(DLMIX_SECRET)"]
    assert rc["readinessProbe"]["httpGet"]["path"] == "/health" and "tcpSocket" in rc["livenessProbe"]
    assert r["spec"]["template"]["spec"]["volumes"] == [{"name": "config",
                                                         "configMap": {"name": "mixed-chips-router-config"}}]
    assert svcs["mixed-chips-router"]["spec"]["ports"][0]["port"] == 8000
    admin = svcs["mixed-chips-router-admin"]["spec"]
    assert admin["clusterIP"] == "None" and admin["publishNotReadyAddresses"] is True
    cfg = RouterConfig.from_dict(yaml.safe_load(_by(objs, "ConfigMap")["mixed-chips-router-config"]["data"]
                                                ["router.yaml"]))
    assert (cfg.host, cfg.port, cfg.policy, cfg.admin_key, cfg.instances) == ("0.0.0.0", 8000, "cost", None, [])
    # two router replicas share the fleet's state through an etcd member that only the router pods can reach
    assert r["spec"]["replicas"] == 2
    assert cfg.etcd_endpoints == ["http://mixed-chips-etcd:2379"] and cfg.etcd_prefix == "/dlmix/mixed-chips"
    assert cfg.etcd_allow_open is True
    etcd = deps["mixed-chips-etcd"]
    assert etcd["spec"]["replicas"] == 1
    assert svcs["mixed-chips-etcd"]["spec"]["selector"] == etcd["spec"]["selector"]["matchLabels"]
    assert svcs["mixed-chips-etcd"]["spec"]["ports"][0]["port"] == 2379
    ec = _containers(etcd)[0]
    assert ec["command"][ec["command"].index("--advertise-client-urls") + 1] == "http://mixed-chips-etcd:2379"
    pol = _by(objs, "NetworkPolicy")["mixed-chips-etcd"]["spec"]
    assert pol["podSelector"]["matchLabels"] == etcd["spec"]["selector"]["matchLabels"]
    assert pol["ingress"] == [{"from": [{"podSelector": {"matchLabels": r["spec"]["selector"]["matchLabels"]}}],
                               "ports": [{"protocol": "TCP", "port": 2379}]}]
    sec = _by(objs, "Secret")["mixed-chips-secret"]
    assert sec["stringData"] == {"secret": "s3cret"}
    assert any("devices '1' left out" in n for n in m.notes)


def test_static_instances_are_reached_through_their_services_and_settings_apply():
    text = (ROOT / "examples/mock-aggregated.yaml").read_text() + (
        "k8s: {namespace: serving, image: reg.example/dlmix:1, labels: {team: ml}}\n")
    dep = Deployment.from_yaml(text)
    dep.router.replicas = 3
    dep.instances[0].k8s.replicas = 2
    dep.instances[1].k8s.requests = {"cpu": "2", "memory": "1Gi"}
    m = build_manifests(dep)
    for o in m.objects:
        _validate(o)
        assert o["metadata"]["namespace"] == "serving" and o["metadata"]["labels"]["team"] == "ml"
    deps = _by(m.objects, "Deployment")
    assert deps["mock-aggregated-router"]["spec"]["replicas"] == 3
    assert deps["mock-aggregated-mock-a"]["spec"]["replicas"] == 2
    b = deps["mock-aggregated-mock-b"]
    _check_workload(b)
    c = _containers(b)[0]
    assert c["image"] == "reg.example/dlmix:1" and c["args"][:2] == ["-m", "dlmix.testing.mock_engine"]
    assert c["resources"] == {"limits": {"cpu": "2", "memory": "1Gi"}, "requests": {"cpu": "2", "memory": "1Gi"}}
    assert "nodeSelector" not in b["spec"]["template"]["spec"]                       # CPU: no vendor label
    cfg = yaml.safe_load(_by(m.objects, "ConfigMap")["mock-aggregated-router-config"]["data"]["router.yaml"])
    assert [(i["id"], i["url"]) for i in cfg["instances"]] == [("mock-a", "http://mock-aggregated-mock-a:8101"),
                                                               ("mock-b", "http://mock-aggregated-mock-b:8102")]
    assert len(_by(m.objects, "Secret")["mock-aggregated-secret"]["stringData"]["secret"]) == 64


def test_every_catalog_accelerator_gets_its_vendor_resource():
    cat = load_catalog()
    chips = [c for c in cat.chips if cat.vendor_of(c).k8s_resource]
    assert {"H100", "Ascend910B", "K100", "C500", "BI-V150", "MTT-S4000", "S60"} <= set(chips)
    inst = "\n".join(f"  - {{name: e{j}, chip: {c}, device: cuda, port: {9000 + j}, role: both}}"
                     for j, c in enumerate(chips))
    dep = Deployment.from_yaml(f"model: m\nrouter: {{port: 8000}}\ninstances:\n{inst}\n")
    deps = _by(build_manifests(dep).objects, "Deployment")
    for j, c in enumerate(chips):
        pod = deps[f"dlmix-e{j}"]["spec"]["template"]["spec"]
        assert pod["containers"][0]["resources"]["limits"] == {cat.vendor_of(c).k8s_resource: "1"}
        assert pod["nodeSelector"] == {cat.vendor_of(c).k8s_node_label: cat.chip(c).name}
    # a vendor without a published resource needs k8s.resource; k8s.node_selector replaces the default
    bad = Deployment.from_yaml("model: m\ninstances:\n  - {chip: PPU, device: cuda, port: 9000}\n")
    with pytest.raises(ConfigError) as ei:
        build_manifests(bad)
    assert "instances[0].k8s.resource" in str(ei.value) and "PPU" in str(ei.value)
    ok = Deployment.from_yaml("model: m\ninstances:\n  - {chip: PPU, device: cuda, port: 9000, tensor_parallel_size: 4,"
                              " k8s: {resource: example.com/ppu, node_selector: {pool: ppu}}}\n")
    pod = _by(build_manifests(ok).objects, "Deployment")["dlmix-both-0"]["spec"]["template"]["spec"]
    assert pod["containers"][0]["resources"]["limits"] == {"example.com/ppu": "4"} and pod["nodeSelector"] == {
        "pool": "ppu"}


def test_cli_emit_k8s(tmp_path):
    out = tmp_path / "k8s"
    r = subprocess.run([sys.executable, "-m", "dlmix.cli", "launch", str(ROOT / "examples/mixed-chips.yaml"),
                        "--emit", "k8s", str(out)], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "COLUMNS": "200"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"kubectl apply -f {out}" in r.stdout and len(list(out.glob("*.yaml"))) == 14
    r = subprocess.run([sys.executable, "-m", "dlmix.cli", "launch", str(ROOT / "examples/mixed-chips.yaml"),
                        "--emit", "helm", str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "unknown --emit format 'helm'" in r.stdout


def test_emitting_again_names_the_files_it_did_not_write(tmp_path):
    """Emitting a changed deployment (here: router.replicas 2 -> 1, which drops the etcd objects) into the folder of
    an earlier emission leaves that emission's extra files, which `kubectl apply -f DIR` would apply too: a note
    names them; a fresh folder gets no such note."""
    dep = Deployment.from_file(ROOT / "examples/mixed-chips.yaml")
    out = tmp_path / "k8s"
    first = emit_k8s(dep, out, secret="s3cret")
    assert not [n for n in first.notes if "did not write" in n]
    assert any("etcd" in f for f in first.files)
    dep.router.replicas = 1
    second = emit_k8s(dep, out, secret="s3cret")
    stale = sorted(set(first.files) - set(second.files))
    assert stale and not any("etcd" in f for f in second.files)
    (note,) = [n for n in second.notes if "did not write" in n]
    assert f"{out} also holds {len(stale)} manifest file(s) this emission did not write ({stale[0]}" in note
    assert f"kubectl apply -f {out}" in note


def test_sglang_instances_are_refused_with_the_reason(tmp_path):
    from dlmix.launch.config import ConfigError

    dep = Deployment.from_file(ROOT / "examples/sglang-cpu-pd.yaml")
    with pytest.raises(ConfigError) as ei:
        emit_k8s(dep, tmp_path / "k8s", secret="s3cret")
    assert "instances[0].engine: --emit k8s does not support SGLang" in str(ei.value)
    assert not (tmp_path / "k8s").exists()


def test_lmdeploy_instances_register_from_their_pods(tmp_path):
    """The seed's mode (b) on Kubernetes: the LMDeploy prefill (MetaX) and decode (PPU, its device resource set in
    the file: the catalog has none for it) run LMDeploy's console script with their pod IP, select the DLMix
    migration backend, and get their DLMix settings in ``DLMIX_LMDEPLOY_CONFIG``: the file's own transport, the
    endpoint on the pod IP at the declared ``kv-side`` port, the Secret for the transport and the router's admin
    API, and self-registration with the router through its admin Service (LMDeploy's ``--proxy-url`` cannot send an
    admin key). Every ``$(VAR)`` in args and env values is defined before it is used (Kubernetes expands only
    those)."""
    dep = Deployment.from_file(ROOT / "examples/lmdeploy-metax-prefill-ppu-decode.yaml")
    with pytest.raises(ConfigError, match="decode-ppu|instances\\[1\\].k8s.resource"):
        build_manifests(dep, secret="s3cret")
    dep.instances[1].k8s.resource = "example.com/ppu"
    m = emit_k8s(dep, tmp_path / "k8s", secret="s3cret")
    objs = [yaml.safe_load(f.read_text()) for f in sorted((tmp_path / "k8s").iterdir())]
    for o in objs:
        _validate(o)
    deps, svcs = _by(objs, "Deployment"), _by(objs, "Service")
    assert set(deps) == {"lmdeploy-metax-ppu-router", "lmdeploy-metax-ppu-prefill-metax",
                         "lmdeploy-metax-ppu-decode-ppu"}
    want = {"prefill-metax": ("Prefill", "maca", 23334, {"metax-tech.com/gpu": "1"}, "C500"),
            "decode-ppu": ("Decode", "cuda", 23335, {"example.com/ppu": "1"}, "PPU")}
    for inst, (role, device, port, limits, chip) in want.items():
        d = deps[f"lmdeploy-metax-ppu-{inst}"]
        _check_workload(d)
        pod = d["spec"]["template"]["spec"]
        c = pod["containers"][0]
        a = c["args"]
        assert c["command"] == ["lmdeploy"] and a[:3] == ["serve", "api_server", "/models/Qwen2.5-7B-Instruct"]
        for flag, v in (("--server-name", "$(POD_IP)"), ("--server-port", str(port)), ("--role", role),
                        ("--migration-backend", "DLMix"), ("--device", device), ("--backend", "pytorch")):
            assert a[a.index(flag) + 1] == v, flag
        env = [e["name"] for e in c["env"]]
        for j, e in enumerate(c["env"]):
            for ref in VAR_REF.findall(e.get("value", "")):
                assert ref in env[:j], (inst, e["name"], ref)
        cfg = json.loads(next(e["value"] for e in c["env"] if e["name"] == "DLMIX_LMDEPLOY_CONFIG"))
        assert cfg == {"shared_secret": "$(DLMIX_SECRET)", "host": "$(POD_IP)", "transport": "dlslime",
                       "port": SIDE_CHANNEL_PORT, "router_url": "http://lmdeploy-metax-ppu-router-admin:8000",
                       "router_admin_key": "$(DLMIX_SECRET)", "public_url": f"http://$(POD_IP):{port}",
                       "instance_id": inst, "model_name": "qwen2.5-7b", "chip_profile": chip}
        assert {"name": "kv-side", "containerPort": SIDE_CHANNEL_PORT} in c["ports"]
        assert c["resources"]["limits"] == limits and pod["nodeSelector"] == {"dlmix.io/chip": chip}
        assert svcs[f"lmdeploy-metax-ppu-{inst}"]["spec"]["ports"][0]["port"] == port
    cfg = RouterConfig.from_dict(yaml.safe_load(_by(objs, "ConfigMap")["lmdeploy-metax-ppu-router-config"]["data"]
                                                ["router.yaml"]))
    assert cfg.instances == []  # both register themselves
    assert any("RDMA" in n and "prefill-metax" in n for n in m.notes)
