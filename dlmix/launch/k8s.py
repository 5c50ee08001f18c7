"""Kubernetes manifests from a deployment file: ``dlmix launch FILE.yaml --emit k8s DIR``.

The same file that ``dlmix launch`` runs on one host becomes, per object, one YAML file in ``DIR`` (apply with
``kubectl apply -f DIR``):

* ``Secret`` ``NAME-secret``: the shared secret (router admin key, connector HMAC key): the file's ``secret``, or
  a new random one (the file is written mode 0600);
* ``ConfigMap`` ``NAME-router-config``: the router config ``dlmix launch`` would generate (plus extra chip catalogs),
  listening on ``0.0.0.0``; the admin key comes from the Secret as a flag;
* ``Deployment`` ``NAME-router`` (``router.replicas``), a client ``Service`` ``NAME-router`` (``k8s.service_type``)
  and a headless ``Service`` ``NAME-router-admin`` that also lists not-ready routers, through which engines register
  (a router is ready only once it has a healthy instance);
* with ``router.replicas`` > 1: an etcd member (``Deployment``/``Service`` ``NAME-etcd``, ``k8s.etcd_image``, data in
  an ``emptyDir``: engines register again on their next heartbeat after it restarts) through which the replicas share
  the fleet's state (:mod:`dlmix.router.shared`), and a ``NetworkPolicy`` ``NAME-etcd`` that admits only the router
  pods to it;
* per instance (an instance group): a ``Deployment`` ``NAME-INSTANCE`` (``k8s.replicas`` pods) with the vendor's
  device resource (``k8s_resource`` of the chip's vendor in the chip catalog, ``dlmix/data/chips.yaml``) and a node
  selector (vendor ``k8s_node_label`` = chip name), and a ``Service`` ``NAME-INSTANCE``.

Engines run the command line ``dlmix launch`` builds, with ``--host $(POD_IP)`` (the pod's IP from the downward API;
Kubernetes expands ``$(VAR)`` in ``args`` and in later ``env`` values), so self-registering engines (DLMix connector;
LMDeploy, whose ``DLMIX_LMDEPLOY_CONFIG`` carries the router's admin Service, the Secret and the pod IP) announce
their pod IP; others are listed in the router config by their Service. LMDeploy runs as its console script next to
``k8s.python``; its DLMix endpoint listens on the pod IP at a fixed port (``port`` of its own settings, default
:data:`SIDE_CHANNEL_PORT`), declared as ``kv-side``. Probes: engines ``startupProbe`` (allows
``ready_timeout_s``), ``readinessProbe`` and ``livenessProbe`` on ``GET /health`` (SGLang: ``/ready``); the router
``readinessProbe`` on ``GET /health`` (200 once an instance is healthy) and a TCP ``livenessProbe``. Restarts are
Kubernetes' own (``restartPolicy: Always`` with its back-off), not the local supervisor.

Local-only features are left out with a note in :attr:`Manifests.notes`: KV events over IPC sockets, CPU pinning with
``taskset``, device ids (the device plugin assigns devices).
"""
from __future__ import annotations

import json
import math
import os
import re
import secrets as _secrets
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import yaml

from dlmix.launch.config import DEVICE_VISIBILITY_ENV, ConfigError, ConnectorSettings, Deployment
from dlmix.net import parse_cpus

__all__ = ["Manifests", "build_manifests", "emit_k8s", "dns_name", "SIDE_CHANNEL_PORT"]

SIDE_CHANNEL_PORT = 14600   # connector side-channel port inside every engine pod (own network namespace)
CONFIG_DIR = "/etc/dlmix"
_DNS = re.compile(r"[^a-z0-9-]+")


def dns_name(*parts: str) -> str:
    """A DNS-1123 label from ``parts`` (lowercase, ``-``-joined, invalid characters to ``-``, at most 63 chars).
    Raises ValueError when nothing valid is left."""
    s = _DNS.sub("-", "-".join(parts).lower()).strip("-")
    s = re.sub(r"-{2,}", "-", s)[:63].rstrip("-")
    if not s:
        raise ValueError(f"cannot make a Kubernetes name from {parts!r}")
    return s


@dataclass
class Manifests:
    """Generated objects (plain dicts in Kubernetes' JSON form), their file names, and notes on what was left out."""

    objects: List[dict] = field(default_factory=list)
    files: List[str] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)

    def add(self, obj: dict) -> None:
        self.objects.append(obj)
        self.files.append(f"{len(self.objects):02d}-{obj['kind'].lower()}-{obj['metadata']['name']}.yaml")


def _cpu_count(cpus: Optional[str]) -> int:
    return len(parse_cpus(cpus)) if cpus else 0


def _http_probe(path: str, port: int, period: int, failures: int, timeout: int = 5) -> dict:
    return {"httpGet": {"path": path, "port": port}, "periodSeconds": period, "failureThreshold": failures,
            "timeoutSeconds": timeout}


def build_manifests(dep: Deployment, secret: Optional[str] = None) -> Manifests:
    """The Kubernetes objects of ``dep`` (see the module docstring).

    Args:
        dep: a validated deployment.
        secret: value of the shared secret; default: the file's ``secret``, else a new random 64-hex-digit one.

    Returns:
        :class:`Manifests` (objects in apply order: Secret, ConfigMap, router, engines).

    Raises:
        ConfigError: an instance on an accelerator whose vendor publishes no device resource and that sets no
            ``k8s.resource``; a name that cannot become a Kubernetes name; an SGLang instance (not supported yet).
    """
    from dlmix.hw.profiles import load_catalog
    from dlmix.launch.runner import plan

    k = dep.k8s
    out = Manifests()
    sg = [f"instances[{i}]" for i, inst in enumerate(dep.instances) if inst.engine == "sglang"]
    if sg:  # the bootstrap server's port and SGLang's own registration are not generated yet
        raise ConfigError([f"{x}.engine: --emit k8s does not support SGLang instances yet (run them with dlmix "
                           "launch, or write their manifests by hand)" for x in sg])
    try:
        base = dns_name(dep.name)
    except ValueError as e:
        raise ConfigError([f"name: {e}"]) from None
    catalog = load_catalog(dep.router.chips if dep.router else None)
    common = {"app.kubernetes.io/name": "dlmix", "app.kubernetes.io/instance": base, **k.labels}

    def meta(name: str, component: str, extra: Optional[Dict[str, str]] = None) -> dict:
        m = {"name": name, "labels": {**common, "app.kubernetes.io/component": component, **(extra or {})}}
        if k.namespace:
            m["namespace"] = k.namespace
        return m

    secret_name = f"{base}-secret"
    value = secret or (dep.secret if dep.secret and dep.secret != "auto" else _secrets.token_hex(32))
    out.add({"apiVersion": "v1", "kind": "Secret", "metadata": meta(secret_name, "secret"), "type": "Opaque",
             "stringData": {"secret": value}})

    # the deployment as seen inside the cluster: engines bind their pod IP, register through the admin Service
    kdep = dep.model_copy(deep=True)
    admin_svc, router_name = f"{base}-router-admin", f"{base}-router"
    svc_of: Dict[str, str] = {}
    kv_port: Dict[int, int] = {}  # LMDeploy PD instances: their DLMix endpoint's port
    for i, inst in enumerate(kdep.instances):
        name = dep.instance_name(i)
        svc_of[name] = dns_name(base, name)
        inst.host = "$(POD_IP)"
        inst.python = k.python
        conn = kdep.connector_of(i)
        if conn is not None and conn.name == "DLMixConnector" and "port" not in conn.extra_config:
            inst.connector = ConnectorSettings(**{**conn.model_dump(), "extra_config": {
                **conn.extra_config, "port": SIDE_CHANNEL_PORT}})
        if inst.engine == "lmdeploy" and inst.role != "both":
            own = inst.env.get("DLMIX_LMDEPLOY_CONFIG", kdep.env.get("DLMIX_LMDEPLOY_CONFIG"))
            try:
                cfg = json.loads(own) if own else {}
            except ValueError:
                cfg = None  # not JSON: passed on as it is, for the engine to refuse with the reason
            if isinstance(cfg, dict):
                port = cfg.get("port")
                if not (isinstance(port, int) and not isinstance(port, bool) and port > 0):
                    port = cfg["port"] = SIDE_CHANNEL_PORT  # fixed, so that the pod can declare it
                inst.env["DLMIX_LMDEPLOY_CONFIG"] = json.dumps(cfg)
                kv_port[i] = port
            elif own is not None:
                inst.env["DLMIX_LMDEPLOY_CONFIG"] = own
            transport = cfg.get("transport") if isinstance(cfg, dict) else None
            if transport not in (None, "tcp", "shm"):
                out.notes.append(f"{name}: transport {transport!r} reads over RDMA: give the pod the node's RDMA "
                                 "NIC (its device plugin's resource in k8s.requests, and the IPC_LOCK capability)")
        if inst.cpus and inst.device != "cpu":
            out.notes.append(f"{name}: cpus {inst.cpus!r} (taskset pinning) left out; use k8s.requests cpu")
    if kdep.router_enabled():
        kdep.router.host = admin_svc  # type: ignore[union-attr]
        if kdep.router.kv_events:  # type: ignore[union-attr]
            kdep.router.kv_events = False  # type: ignore[union-attr]
            out.notes.append("router.kv_events left out: the KV-event publishers use local IPC sockets")
    with tempfile.TemporaryDirectory(prefix="dlmix-k8s-") as tmp:
        plans = plan(kdep, "$(DLMIX_SECRET)", Path(tmp), models={i: dep.model_of(i) or ""
                                                                  for i in range(len(dep.instances))})
        rcfg = yaml.safe_load((Path(tmp) / "router.yaml").read_text()) if kdep.router_enabled() else None

    env_base = [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                {"name": "DLMIX_SECRET", "valueFrom": {"secretKeyRef": {"name": secret_name, "key": "secret"}}}]
    visibility = set(DEVICE_VISIBILITY_ENV.values())

    def env_list(env: Dict[str, str]) -> List[dict]:
        return env_base + [{"name": n, "value": str(v)} for n, v in env.items() if n not in visibility]

    # ---------------------------------------------------------------- router
    if rcfg is not None:
        r = dep.router
        data: Dict[str, str] = {}
        rcfg.pop("admin_key", None)
        rcfg["host"] = "0.0.0.0"
        if not rcfg.get("api_keys"):
            rcfg["allow_open"] = True  # inside the cluster; put keys in router.config.api_keys to require them
        for entry in rcfg.get("instances", []):
            entry["url"] = f"http://{svc_of[entry['id']]}:{dep.instances[_index(dep, entry['id'])].port}"
        if rcfg.get("chips"):
            paths = []
            for j, c in enumerate(r.chips):  # type: ignore[union-attr]
                data[f"chips-{j}.yaml"] = Path(c).expanduser().read_text()
                paths.append(f"{CONFIG_DIR}/chips-{j}.yaml")
            rcfg["chips"] = paths
        for key in ("model_spec", "tokenizer"):
            v = rcfg.get(key)
            if isinstance(v, str) and os.path.isabs(v):
                out.notes.append(f"router {key} {v!r} is a local path: mount it into the router pods or set "
                                 f"router.{key} to a preset / hub id")
        sel = {"app.kubernetes.io/instance": base, "app.kubernetes.io/component": "router"}
        if r.replicas > 1:  # type: ignore[union-attr]
            etcd_name = f"{base}-etcd"
            url = f"http://{etcd_name}:2379"
            rcfg["etcd_endpoints"] = [url]
            rcfg["etcd_prefix"] = f"/dlmix/{base}"
            rcfg["etcd_allow_open"] = True  # only the router pods reach it (the NetworkPolicy below)
            esel = {"app.kubernetes.io/instance": base, "app.kubernetes.io/component": "etcd"}
            out.add({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta(etcd_name, "etcd"),
                     "spec": {"replicas": 1, "selector": {"matchLabels": esel},
                              "template": {"metadata": {"labels": {**common, **esel}}, "spec": {
                                  "containers": [{
                                      "name": "etcd", "image": k.etcd_image, "imagePullPolicy": k.image_pull_policy,
                                      "command": ["etcd", "--name", "etcd", "--data-dir", "/var/lib/etcd",
                                                  "--listen-client-urls", "http://0.0.0.0:2379",
                                                  "--advertise-client-urls", url,
                                                  "--listen-peer-urls", "http://127.0.0.1:2380"],
                                      "ports": [{"name": "client", "containerPort": 2379}],
                                      "readinessProbe": _http_probe("/health", 2379, 5, 3),
                                      "livenessProbe": _http_probe("/health", 2379, 10, 3),
                                      "volumeMounts": [{"name": "data", "mountPath": "/var/lib/etcd"}]}],
                                  "volumes": [{"name": "data", "emptyDir": {}}]}}}})
            out.add({"apiVersion": "v1", "kind": "Service", "metadata": meta(etcd_name, "etcd"),
                     "spec": {"selector": esel, "ports": [{"name": "client", "port": 2379, "targetPort": 2379}]}})
            out.add({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": meta(etcd_name, "etcd"),
                     "spec": {"podSelector": {"matchLabels": esel}, "policyTypes": ["Ingress"],
                              "ingress": [{"from": [{"podSelector": {"matchLabels": sel}}],
                                           "ports": [{"protocol": "TCP", "port": 2379}]}]}})
        data["router.yaml"] = yaml.safe_dump(rcfg, sort_keys=False)
        cm_name = f"{base}-router-config"
        out.add({"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta(cm_name, "router"), "data": data})
        port = r.port  # type: ignore[union-attr]
        container = {
            "name": "router", "image": k.router_image or k.image, "imagePullPolicy": k.image_pull_policy,
            "command": [k.python, "-m", "dlmix.cli", "router"],
            "args": ["--config", f"{CONFIG_DIR}/router.yaml", "--admin-key", "$(DLMIX_SECRET)"],
            "env": env_list(dict(dep.env)), "ports": [{"name": "http", "containerPort": port}],
            "readinessProbe": _http_probe("/health", port, 5, 2, 2),
            "livenessProbe": {"tcpSocket": {"port": port}, "periodSeconds": 10, "failureThreshold": 3},
            "volumeMounts": [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True}]}
        out.add({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta(router_name, "router"),
                 "spec": {"replicas": r.replicas, "selector": {"matchLabels": sel},  # type: ignore[union-attr]
                          "template": {"metadata": {"labels": {**common, **sel}},
                                       "spec": {"containers": [container],
                                                "volumes": [{"name": "config",
                                                             "configMap": {"name": cm_name}}]}}}})
        out.add({"apiVersion": "v1", "kind": "Service", "metadata": meta(router_name, "router"),
                 "spec": {"type": k.service_type, "selector": sel,
                          "ports": [{"name": "http", "port": port, "targetPort": port}]}})
        out.add({"apiVersion": "v1", "kind": "Service", "metadata": meta(admin_svc, "router"),
                 "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": sel,
                          "ports": [{"name": "http", "port": port, "targetPort": port}]}})

    # ---------------------------------------------------------------- engines
    for pl in (p for p in plans if p.kind == "engine"):
        i = pl.index
        inst, kinst = dep.instances[i], dep.instances[i].k8s
        name = svc_of[pl.name]
        argv = list(pl.argv)
        if argv and argv[0] == "taskset":
            argv = argv[3:]
        # vLLM runs as ``python -m ...``; LMDeploy as its console script, next to the image's python
        argv[0] = str(Path(k.python).parent / "lmdeploy") if inst.engine == "lmdeploy" else k.python
        vendor = catalog.vendor_of(inst.chip)
        limits: Dict[str, object] = {}
        requests: Dict[str, object] = dict(kinst.requests)
        if inst.device != "cpu":
            res = kinst.resource or vendor.k8s_resource
            if not res:
                raise ConfigError([f"instances[{i}].k8s.resource: chip {inst.chip!r} (vendor {vendor.name!r}) has "
                                   f"no Kubernetes device resource in the chip catalog; set k8s.resource"])
            n = max(inst.tensor_parallel_size, len([d for d in (inst.devices or "").split(",") if d.strip()]))
            limits[res] = str(n)
        elif inst.cpus and "cpu" not in requests:
            requests["cpu"] = str(_cpu_count(inst.cpus))
        for key, v in kinst.requests.items():
            if key in ("memory", "cpu", "ephemeral-storage") or "/" in key:
                limits.setdefault(key, v)
        node_sel = kinst.node_selector if kinst.node_selector is not None else (
            {vendor.k8s_node_label: inst.chip} if vendor.k8s_node_label else {})
        ports = [{"name": "http", "containerPort": inst.port}]
        conn = kdep.connector_of(i)
        if conn is not None and conn.name == "DLMixConnector":
            ports.append({"name": "kv-side", "containerPort": int(conn.extra_config["port"])})
        if i in kv_port:
            ports.append({"name": "kv-side", "containerPort": kv_port[i]})
        extra = {"dlmix.io/instance": pl.name, "dlmix.io/role": inst.role, "dlmix.io/chip": inst.chip}
        sel = {"app.kubernetes.io/instance": base, "dlmix.io/instance": dns_name(pl.name)}
        container = {
            "name": "engine", "image": kinst.image or k.image, "imagePullPolicy": k.image_pull_policy,
            "command": argv[:1], "args": argv[1:], "env": env_list(pl.env), "ports": ports,
            "startupProbe": _http_probe(pl.health_path, inst.port, 10,
                                        max(1, math.ceil(inst.ready_timeout_s / 10))),
            "readinessProbe": _http_probe(pl.health_path, inst.port, 5, 2),
            "livenessProbe": _http_probe(pl.health_path, inst.port, 10, 3)}
        if limits or requests:
            container["resources"] = {k_: v for k_, v in (("limits", limits), ("requests", requests)) if v}
        pod: dict = {"containers": [container]}
        if node_sel:
            pod["nodeSelector"] = node_sel
        if kinst.tolerations:
            pod["tolerations"] = list(kinst.tolerations)
        labels = {**extra, "dlmix.io/instance": dns_name(pl.name)}
        out.add({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta(name, "engine", labels),
                 "spec": {"replicas": kinst.replicas, "selector": {"matchLabels": sel},
                          "template": {"metadata": {"labels": {**common, "app.kubernetes.io/component": "engine",
                                                               **labels}},
                                       "spec": pod}}})
        out.add({"apiVersion": "v1", "kind": "Service", "metadata": meta(name, "engine", labels),
                 "spec": {"selector": sel, "ports": [{"name": "http", "port": inst.port, "targetPort": inst.port}]}})
        if inst.devices:
            out.notes.append(f"{pl.name}: devices {inst.devices!r} left out; the device plugin assigns "
                             f"{limits.get(kinst.resource or vendor.k8s_resource or '', 0)} device(s)")
    return out


def _index(dep: Deployment, name: str) -> int:
    return next(i for i in range(len(dep.instances)) if dep.instance_name(i) == name)


def emit_k8s(dep: Deployment, out_dir: str | os.PathLike, secret: Optional[str] = None) -> Manifests:
    """Write :func:`build_manifests` of ``dep`` to ``out_dir`` (created), one object per file; the Secret's file is
    mode 0600. Files of an earlier emission (of another deployment, or of this one before an instance was removed
    or ``router.replicas`` lowered) are not removed: a note names them, since ``kubectl apply -f out_dir`` would
    apply them too. Returns the manifests."""
    m = build_manifests(dep, secret)
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    for obj, fname in zip(m.objects, m.files):
        text = yaml.safe_dump(obj, sort_keys=False)
        mode = 0o600 if obj["kind"] == "Secret" else 0o644
        fd = os.open(d / fname, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        with os.fdopen(fd, "w") as f:
            f.write(text)
    others = sorted(p.name for p in d.iterdir() if p.suffix in (".yaml", ".yml", ".json") and p.name not in m.files)
    if others:
        m.notes.append(f"{d} also holds {len(others)} manifest file(s) this emission did not write ("
                       f"{', '.join(others[:3])}{', ...' if len(others) > 3 else ''}): `kubectl apply -f {d}` would "
                       "apply them too; remove them or emit into an empty folder")
    return m
