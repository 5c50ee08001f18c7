"""Deployment files of ``dlmix launch``: schema (pydantic), YAML parsing with line numbers, cross-field checks.

A deployment file describes engine instances and, optionally, a dlmix router in front of them::

    name: cpu-pd
    model: smollm2                 # default model of every instance: dlmix model name, local path or hub id
    router:                        # optional; omit for engines alone
      port: 8000
      policy: prefix               # round_robin | least_load | prefix | cost
    instances:
      - name: prefill
        role: prefill              # prefill | decode | both
        port: 8100
        chip: cpu-x86              # chip profile (dlmix/data/chips.yaml or router.chips files)
        cpus: "0"                  # CPU cores to pin (vLLM CPU: VLLM_CPU_OMP_THREADS_BIND; other devices: taskset)
        kv: {block_size: 32, dtype: bfloat16}
      - name: decode
        role: decode
        port: 8200
        cpus: "1"
        kv: {block_size: 128, dtype: float32}

Optional sections: ``restart:`` (supervision after start-up, :class:`RestartPolicy`; also per instance and on the
router) and ``k8s:`` (``--emit k8s`` manifests, :class:`K8sSettings`; per instance :class:`K8sInstanceSettings`).

Every error names the field path and the YAML line: ``cpu-pd.yaml:14:9: instances[1].kv.block_size: ...``.
A vLLM or SGLang instance is also checked against its model when the model's ``config.json`` can be read here
without building or downloading (a local folder, a built dlmix model): ``tensor_parallel_size`` must split the
model's attention and KV heads, ``max_model_len`` must not exceed its context limit (:func:`_model_fit`).
Unknown keys are errors (a typo never falls back to a default). See ``examples/*.yaml`` and docs.
"""
from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any, Dict, List, Literal, Optional, Tuple

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from dlmix.errors import ConfigError as _BaseConfigError
from dlmix.net import parse_cpus, url_host

__all__ = ["ConfigError", "Deployment", "Instance", "KVSettings", "RouterSettings", "ConnectorSettings",
           "RestartPolicy", "K8sSettings", "K8sInstanceSettings", "DEVICE_VISIBILITY_ENV", "parse_deployment"]

# Environment variable that restricts the visible devices of an engine, per device kind.
DEVICE_VISIBILITY_ENV = {
    "cuda": "CUDA_VISIBLE_DEVICES",
    "rocm": "HIP_VISIBLE_DEVICES",
    "npu": "ASCEND_RT_VISIBLE_DEVICES",
    "xpu": "ZE_AFFINITY_MASK",
    "musa": "MUSA_VISIBLE_DEVICES",
    "mlu": "MLU_VISIBLE_DEVICES",
    "gcu": "TOPS_VISIBLE_DEVICES",
    "maca": "CUDA_VISIBLE_DEVICES",
}
DEVICES = ("cpu",) + tuple(DEVICE_VISIBILITY_ENV)


class ConfigError(_BaseConfigError):
    """Invalid deployment file. ``str(e)`` is ``FILE:LINE:COL: field.path: message`` (one line per problem)."""

    def __init__(self, problems: List[str]):
        super().__init__("\n".join(problems))
        self.problems = problems


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class KVSettings(_Strict):
    """KV cache layout and size of one instance.

    Attributes:
        block_size: KV block size in tokens (``--block-size``); vLLM CPU needs a multiple of 32.
        dtype: model/activation dtype (``--dtype``); the KV cache has this dtype unless ``cache_dtype`` is set.
        cache_dtype: ``--kv-cache-dtype`` (``auto``, ``fp8``, ``fp8_e4m3``, ``fp8_e5m2``, ...).
        cache_bytes: ``--kv-cache-memory-bytes`` (bytes). Default 128 MiB on CPU; on accelerators None lets
            ``gpu_memory_utilization`` size it.
        gpu_memory_utilization: ``--gpu-memory-utilization`` fraction (accelerators only).
    """

    block_size: Optional[int] = Field(default=None, ge=1, le=4096)
    dtype: Optional[Literal["auto", "bfloat16", "float16", "float32", "half", "float"]] = None
    cache_dtype: Optional[str] = None
    cache_bytes: Optional[int] = Field(default=None, ge=1 << 20)
    gpu_memory_utilization: Optional[float] = Field(default=None, gt=0, le=1)


class RestartPolicy(_Strict):
    """Supervision of a process after the deployment is ready (:mod:`dlmix.launch.supervisor`).

    A process that exits (or whose restart does not answer ``/health`` within its ``ready_timeout_s``) is restarted
    after ``min(backoff_s * 2**k, backoff_max_s)`` seconds, ``k`` = restarts so far (exponential back-off, as
    Kubernetes' CrashLoopBackOff and systemd's ``RestartSec``/``RestartSteps``). After ``max_restarts`` restarts
    in a row it is given up; a process that served for ``reset_after_s`` seconds has its count reset to 0.

    Attributes:
        max_restarts: restarts before giving up (0 = never restart).
        backoff_s: first delay, seconds.
        backoff_max_s: largest delay, seconds.
        reset_after_s: seconds of healthy running after which the restart count starts again at 0.
    """

    max_restarts: int = Field(default=5, ge=0)
    backoff_s: float = Field(default=1.0, ge=0, allow_inf_nan=False)
    backoff_max_s: float = Field(default=60.0, ge=0, allow_inf_nan=False)
    reset_after_s: float = Field(default=300.0, gt=0)

    def delay(self, k: int) -> float:
        """Seconds to wait before restart number ``k + 1`` (``k`` >= 0 restarts done so far)."""
        return min(self.backoff_s * (2.0 ** min(k, 60)), self.backoff_max_s)


class K8sSettings(_Strict):
    """Kubernetes settings of the whole deployment (``dlmix launch FILE --emit k8s DIR``; see docs/launch.md).

    Attributes:
        namespace: namespace of every object (None: the one ``kubectl`` uses).
        image: container image with dlmix and the engine installed (engines and router); per instance ``k8s.image``
            overrides (e.g. a vllm-ascend based image for Ascend instances).
        router_image: image of the router (default ``image``).
        image_pull_policy: ``Always``, ``IfNotPresent`` or ``Never``.
        service_type: type of the router's client Service (``ClusterIP``, ``NodePort``, ``LoadBalancer``).
        python: interpreter inside the images (replaces the local ``python`` paths).
        labels: extra labels on every object.
        etcd_image: image of the etcd member that router replicas share their state through (``router.replicas``
            > 1).
    """

    namespace: Optional[str] = None
    image: str = "dlmix:latest"
    router_image: Optional[str] = None
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    service_type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = "ClusterIP"
    python: str = "python3"
    labels: Dict[str, str] = Field(default_factory=dict)
    etcd_image: str = "quay.io/coreos/etcd:v3.5.17"


class K8sInstanceSettings(_Strict):
    """Kubernetes settings of one instance group (its Deployment).

    Attributes:
        replicas: pods of this group (each one an engine instance; self-registering engines register their pod IP).
        image: container image (default: the deployment's ``k8s.image``).
        resource: device resource name (default: the chip vendor's ``k8s_resource`` in the chip catalog).
        node_selector: node labels (default ``{vendor k8s_node_label: chip name}`` from the chip catalog).
        tolerations: pod tolerations (Kubernetes ``Toleration`` objects as mappings).
        requests: extra container resource requests and limits (e.g. ``{memory: 64Gi, cpu: "8"}``).
    """

    replicas: int = Field(default=1, ge=0)
    image: Optional[str] = None
    resource: Optional[str] = None
    node_selector: Optional[Dict[str, str]] = None
    tolerations: List[Dict[str, Any]] = Field(default_factory=list)
    requests: Dict[str, str] = Field(default_factory=dict)


class ConnectorSettings(_Strict):
    """KV connector of an instance (vLLM ``--kv-transfer-config``).

    Attributes:
        name: ``kv_connector`` (default ``DLMixConnector``; e.g. ``NixlConnector`` for vLLM's own).
        module_path: ``kv_connector_module_path`` (optional).
        extra_config: merged into ``kv_connector_extra_config``. For ``DLMixConnector`` launch fills
            ``router_url``, ``router_admin_key``, ``public_url``, ``chip_profile``, ``model_name``,
            ``shared_secret`` and a free side-channel ``port``; keys given here win.
        kv_role: override of the role-derived ``kv_role`` (``kv_producer`` for prefill, ``kv_consumer`` for decode,
            ``kv_both`` for both).
    """

    name: str = "DLMixConnector"
    module_path: Optional[str] = None
    extra_config: Dict[str, Any] = Field(default_factory=dict)
    kv_role: Optional[Literal["kv_producer", "kv_consumer", "kv_both"]] = None


class Instance(_Strict):
    """One engine instance. See the module docstring for an example.

    Attributes:
        name: unique name (default ``ROLE-INDEX``); prefixes its log lines.
        engine: ``vllm``, ``sglang`` (its prefill/decode instances use the ``dlmix`` transfer backend; SGLang
            usually lives in its own venv: set ``python``), ``lmdeploy`` (its prefill/decode instances use the
            ``DLMix`` migration backend; its own venv too; on ``device: cpu`` the CPU test aid), or ``mock`` (dlmix's test engine
            :mod:`dlmix.testing.mock_engine`).
        model: dlmix model name (``smollm2``, ``tiny-llama``; built by :func:`dlmix.models.prepare`), a local folder,
            or a hub id; default: the deployment's ``model``.
        served_model_name: name clients use (default: deployment's ``served_model_name``, else the model name).
        role: ``prefill``, ``decode`` or ``both``.
        host / port: bind address (default loopback) and port of the OpenAI API.
        chip: chip profile name (catalog of :mod:`dlmix.hw.profiles`), announced to the router.
        device: ``cpu`` or an accelerator kind (``cuda``, ``rocm``, ``npu``, ``xpu``, ``musa``, ``mlu``, ...).
        devices: visible accelerator ids (``"0"``, ``"0,1"``), set through the device kind's visibility variable.
        cpus: CPU cores to pin (``"0"``, ``"0-3"``, ``"0,2"``).
        tensor_parallel_size: ``--tensor-parallel-size``.
        max_model_len: ``--max-model-len`` tokens.
        enforce_eager: ``--enforce-eager`` (default: on for CPU, off otherwise).
        kv: :class:`KVSettings`.
        connector: :class:`ConnectorSettings`; default ``DLMixConnector`` for prefill/decode roles, none for both.
        python: interpreter that runs the engine (e.g. another venv's ``bin/python``); default: this one.
        extra_args: further engine flags, passed as they are.
        env: extra environment variables.
        ready_timeout_s: seconds to wait for ``/health`` (at start and after each restart).
        restart: :class:`RestartPolicy` of this instance (default: the deployment's ``restart``).
        k8s: :class:`K8sInstanceSettings` (only used by ``--emit k8s``).
    """

    name: Optional[str] = None
    engine: Literal["vllm", "sglang", "lmdeploy", "mock"] = "vllm"
    model: Optional[str] = None
    served_model_name: Optional[str] = None
    role: Literal["prefill", "decode", "both"] = "both"
    host: str = "127.0.0.1"
    port: int = Field(ge=1, le=65535)
    chip: str = "cpu-x86"
    device: str = "cpu"
    devices: Optional[str] = None
    cpus: Optional[str] = None
    tensor_parallel_size: int = Field(default=1, ge=1, le=1024)
    max_model_len: int = Field(default=2048, ge=16)
    enforce_eager: Optional[bool] = None
    kv: KVSettings = Field(default_factory=KVSettings)
    connector: Optional[ConnectorSettings] = None
    python: Optional[str] = None
    extra_args: List[str] = Field(default_factory=list)
    env: Dict[str, str] = Field(default_factory=dict)
    ready_timeout_s: float = Field(default=600.0, gt=0, allow_inf_nan=False)
    restart: Optional[RestartPolicy] = None
    k8s: K8sInstanceSettings = Field(default_factory=K8sInstanceSettings)

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if v not in DEVICES:
            raise ValueError(f"unknown device {v!r}; choose one of {', '.join(DEVICES)}")
        return v

    @field_validator("cpus")
    @classmethod
    def _cpus(cls, v: Optional[str]) -> Optional[str]:
        if v is not None:
            parse_cpus(v)  # ValueError names the accepted forms
        return None if v is None else str(v).replace(" ", "")

    @field_validator("extra_args", mode="before")
    @classmethod
    def _args(cls, v: Any) -> Any:
        if isinstance(v, str):
            import shlex

            return shlex.split(v)
        return [str(x) for x in v] if isinstance(v, list) else v

    @property
    def url(self) -> str:
        """``http://host:port`` of the OpenAI API, as this machine reaches it (a wildcard ``host`` becomes loopback,
        an IPv6 one gets brackets: :func:`dlmix.net.url_host`)."""
        return f"http://{url_host(self.host)}:{self.port}"


class RouterSettings(_Strict):
    """The dlmix router in front of the instances (:mod:`dlmix.router`).

    Attributes:
        enabled: start it (default true when the section is present).
        host / port: bind address and port (the deployment's entry point).
        policy / policy_params: routing policy (``round_robin``, ``least_load``, ``prefix``, ``cost``) and its
            parameters.
        model_spec: the router's cost-model spec (preset name, HF folder or dict); default: the model folder
            of the first instance when it is local.
        tokenizer: HF tokenizer path for exact block hashes of text prompts (``model`` = the instances' model
            folder), ``bytes``, or null (approximate).
        chips: extra chip catalog YAML files.
        kv_events: start vLLM KV-event publishers (ZMQ on loopback) and let the router subscribe.
        config: further router config keys (see :class:`dlmix.router.config.RouterConfig`), passed as they are.
        ready_timeout_s: seconds to wait for the router and for every instance to appear in it.
        restart: :class:`RestartPolicy` of the router process (default: the deployment's ``restart``).
        replicas: router replicas in Kubernetes manifests (``--emit k8s``); a local launch runs one. More than one
            share the fleet's state through an etcd member the manifests add (:mod:`dlmix.router.shared`).
    """

    enabled: bool = True
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)
    policy: str = "prefix"
    policy_params: Dict[str, Any] = Field(default_factory=dict)
    model_spec: Any = None
    tokenizer: Optional[str] = None
    chips: List[str] = Field(default_factory=list)
    kv_events: bool = False
    config: Dict[str, Any] = Field(default_factory=dict)
    ready_timeout_s: float = Field(default=120.0, gt=0, allow_inf_nan=False)
    restart: Optional[RestartPolicy] = None
    replicas: int = Field(default=1, ge=1)

    @property
    def url(self) -> str:
        """``http://host:port`` of the router, as this machine reaches it (:func:`dlmix.net.url_host`): what engines
        register at and clients are pointed to."""
        return f"http://{url_host(self.host)}:{self.port}"


class Deployment(_Strict):
    """A whole local deployment (see the module docstring). Build with :meth:`from_file` or :meth:`from_yaml`.

    Attributes:
        name: deployment name (log folder name).
        model: default model of the instances.
        served_model_name: default served model name.
        secret: shared secret (router admin key, connector HMAC); ``null``/``auto`` = generated at each launch.
        router: :class:`RouterSettings` or None (engines alone).
        instances: the engine instances (at least one).
        env: environment variables for every process.
        restart: default :class:`RestartPolicy` of every process (engines and router).
        k8s: :class:`K8sSettings` (only used by ``--emit k8s``).
        source: file the deployment came from (set by :meth:`from_file`).
    """

    name: str = "dlmix"
    model: Optional[str] = None
    served_model_name: Optional[str] = None
    secret: Optional[str] = None
    router: Optional[RouterSettings] = None
    instances: List[Instance] = Field(min_length=1)
    env: Dict[str, str] = Field(default_factory=dict)
    restart: RestartPolicy = Field(default_factory=RestartPolicy)
    k8s: K8sSettings = Field(default_factory=K8sSettings)
    source: Optional[str] = Field(default=None, exclude=True)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_file(cls, path: str | Path) -> "Deployment":
        """Read and validate a deployment file. Raises :class:`ConfigError` (file, line, field, message)."""
        p = Path(path)
        try:
            text = p.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError([f"{p}: cannot read deployment file: {e}"]) from None
        dep = parse_deployment(text, str(p))
        dep.source = str(p)
        return dep

    @classmethod
    def from_yaml(cls, text: str, origin: str = "<deployment>") -> "Deployment":
        """Validate deployment YAML text (``origin`` names it in errors). Raises :class:`ConfigError`."""
        return parse_deployment(text, origin)

    # ------------------------------------------------------------------ derived values
    def router_enabled(self) -> bool:
        """True when a router is configured and enabled."""
        return self.router is not None and self.router.enabled

    def entry_url(self) -> str:
        """Where clients send requests: the router, else the first instance."""
        return self.router.url if self.router_enabled() else self.instances[0].url

    def instance_name(self, i: int) -> str:
        """Name of instance ``i`` (explicit or ``ROLE-INDEX``)."""
        inst = self.instances[i]
        return inst.name or f"{inst.role}-{i}"

    def restart_of(self, i: int) -> RestartPolicy:
        """Restart policy of instance ``i`` (its own, else the deployment's); ``i = -1``: the router's."""
        own = (self.router.restart if self.router else None) if i < 0 else self.instances[i].restart
        return own or self.restart

    def model_of(self, i: int) -> Optional[str]:
        """Model reference of instance ``i`` (its own or the deployment default)."""
        return self.instances[i].model or self.model

    def served_name_of(self, i: int) -> str:
        """Served model name of instance ``i``: explicit, deployment default, else the model reference's last
        path component."""
        inst = self.instances[i]
        if inst.served_model_name or self.served_model_name:
            return inst.served_model_name or self.served_model_name  # type: ignore[return-value]
        m = self.model_of(i) or ("mock" if inst.engine == "mock" else "model")
        return Path(m).name if ("/" in m and Path(m).exists()) else m

    def connector_of(self, i: int) -> Optional[ConnectorSettings]:
        """Connector of instance ``i``: explicit, else ``DLMixConnector`` for prefill/decode roles (vLLM only)."""
        inst = self.instances[i]
        if inst.connector is not None or inst.engine != "vllm":
            return inst.connector if inst.engine == "vllm" else None
        return ConnectorSettings() if inst.role in ("prefill", "decode") else None


# ---------------------------------------------------------------------- YAML with line numbers
Path_ = Tuple[Any, ...]


def _marks(node: yaml.Node, path: Path_, out: Dict[Path_, Tuple[int, int]], problems: List[str],
           origin: str, seen_nodes: Optional[set] = None) -> None:
    """Record (line, column), 1-based, of every node by its path; report duplicate mapping keys. A node reached
    again through a YAML alias is not walked again (nested aliases would otherwise expand exponentially); paths
    under it fall back to the alias's own mark (:func:`_where`)."""
    out[path] = (node.start_mark.line + 1, node.start_mark.column + 1)
    seen_nodes = set() if seen_nodes is None else seen_nodes
    if id(node) in seen_nodes:
        return
    seen_nodes.add(id(node))
    if isinstance(node, yaml.MappingNode):
        seen: Dict[Any, int] = {}
        for k, v in node.value:
            key = k.value if isinstance(k, yaml.ScalarNode) else str(k)
            if key in seen:
                problems.append(f"{origin}:{k.start_mark.line + 1}:{k.start_mark.column + 1}: "
                                f"{_fmt(path + (key,))}: duplicate key (first on line {seen[key]})")
            seen[key] = k.start_mark.line + 1
            out[path + (key, "__key__")] = (k.start_mark.line + 1, k.start_mark.column + 1)
            _marks(v, path + (key,), out, problems, origin, seen_nodes)
    elif isinstance(node, yaml.SequenceNode):
        for i, v in enumerate(node.value):
            _marks(v, path + (i,), out, problems, origin, seen_nodes)


def sglang_bootstrap_port(extra_args: List[str]) -> Optional[int]:
    """The port SGLang's ``--disaggregation-bootstrap-port`` names in an instance's ``extra_args``, or None when it
    is not there. Raises ValueError when no port number (1-65535) follows it."""
    if "--disaggregation-bootstrap-port" not in extra_args:
        return None
    k = extra_args.index("--disaggregation-bootstrap-port")
    v = extra_args[k + 1] if k + 1 < len(extra_args) else ""
    if not v.isdigit() or not 1 <= int(v) <= 65535:
        raise ValueError(f"--disaggregation-bootstrap-port needs a port number (1-65535) after it, got "
                         f"{v or 'nothing'!r}")
    return int(v)


def _fmt(path: Path_) -> str:
    s = ""
    for p in path:
        if p == "__key__":
            continue
        s += f"[{p}]" if isinstance(p, int) else (f".{p}" if s else str(p))
    return s or "(top level)"


def _where(marks: Dict[Path_, Tuple[int, int]], path: Path_, unknown_key: bool = False) -> Tuple[int, int]:
    if unknown_key and path + ("__key__",) in marks:
        return marks[path + ("__key__",)]
    p = tuple(path)
    while p and p not in marks:
        p = p[:-1]
    return marks.get(p, (1, 1))


def parse_deployment(text: str, origin: str = "<deployment>") -> Deployment:
    """Parse and validate deployment YAML. Raises :class:`ConfigError` naming file, line, column and field."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{origin}:{mark.line + 1}:{mark.column + 1}" if mark else origin
        msg = getattr(e, "problem", None) or str(e)
        raise ConfigError([f"{where}: invalid YAML: {msg}"]) from None
    if node is None or not isinstance(data, dict):
        raise ConfigError([f"{origin}:1:1: the file must be a YAML mapping with an 'instances' list"])
    marks: Dict[Path_, Tuple[int, int]] = {}
    problems: List[str] = []
    _marks(node, (), marks, problems, origin)
    if problems:
        raise ConfigError(problems)
    try:
        dep = Deployment.model_validate(data)
    except ValidationError as e:
        for err in e.errors():
            loc = tuple(err["loc"])
            line, col = _where(marks, loc, unknown_key=err["type"] == "extra_forbidden")
            msg = err["msg"]
            if err["type"] == "extra_forbidden":
                near = difflib.get_close_matches(str(loc[-1]), _keys_at(Deployment, loc[:-1]), n=2)
                msg = "unknown key" + (f"; did you mean {' or '.join(repr(n) for n in near)}?" if near else "")
            elif err["type"] == "missing":
                msg = "required field missing"
            elif err["type"] == "literal_error":
                msg = f"{msg}, got {err.get('input')!r}"
            problems.append(f"{origin}:{line}:{col}: {_fmt(loc)}: {msg}")
        raise ConfigError(problems) from None
    _cross_checks(dep, marks, origin)
    return dep


def _keys_at(model: Any, loc: Tuple[Any, ...]) -> List[str]:
    """The field names (YAML keys) of the pydantic model found at ``loc`` inside ``model`` (list indexes and dict keys
    step into the item type; ``Optional`` is looked through); ``[]`` where no model is found."""
    import typing

    t: Any = model
    for part in loc:
        while typing.get_origin(t) is typing.Union:  # Optional[X]
            t = next((a for a in typing.get_args(t) if a is not type(None)), None)
        if isinstance(t, type) and issubclass(t, BaseModel):
            f = t.model_fields.get(part) if isinstance(part, str) else None
            if f is None:
                return []
            t = f.annotation
        elif typing.get_origin(t) in (list, List, dict, Dict):
            t = typing.get_args(t)[-1] if typing.get_args(t) else None
        else:
            return []
    while typing.get_origin(t) is typing.Union:
        t = next((a for a in typing.get_args(t) if a is not type(None)), None)
    if isinstance(t, type) and issubclass(t, BaseModel):
        return [f.alias or n for n, f in t.model_fields.items()]
    return []


#: per engine, the environment variable that lets it run past the model's context limit (vLLM
#: ``vllm/config/model.py`` ``_get_and_verify_max_len``; SGLang ``sglang/srt/configs/model_config.py``)
_LONG_LEN_ENV = {"vllm": "VLLM_ALLOW_LONG_MAX_MODEL_LEN", "sglang": "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"}


def _model_fit(dep: Deployment, i: int, shapes: Dict[str, Any]) -> List[Tuple[str, str]]:
    """``(field, message)`` for each way vLLM/SGLang instance ``i`` does not fit its model, when the model's
    ``config.json`` can be read here without building or downloading (:func:`dlmix.models.local_config`: a built
    dlmix model, a local folder or config.json path; a hub id is not checked): its ``tensor_parallel_size`` must be
    one of :meth:`dlmix.hw.cost.ModelSpec.allowed_tp_sizes` of the model's head counts (on a CPU device too: the
    engine splits the heads the same way), and its ``max_model_len`` at most the model's context limit
    (:func:`dlmix.hw.cost.context_limit`, tokens) unless the engine's override variable (:data:`_LONG_LEN_ENV`) is
    set to 1/true in ``env``. ``shapes`` memoises the model shapes by reference. Raises nothing."""
    from dlmix.hw.cost import ModelSpec
    from dlmix.models import local_config

    ref = dep.model_of(i)
    if not ref:
        return []
    if ref not in shapes:
        cfg = local_config(ref)
        try:
            shapes[ref] = ModelSpec.from_hf_config(cfg) if cfg is not None else None
        except (ValueError, TypeError):
            shapes[ref] = None
    spec = shapes[ref]
    if spec is None:
        return []
    inst = dep.instances[i]
    who = f"instance {dep.instance_name(i)!r} ({inst.engine}, model {ref})"
    out = []
    try:
        allowed = spec.allowed_tp_sizes()
    except ValueError:
        allowed = []
    if allowed and inst.tensor_parallel_size not in allowed:
        out.append(("tensor_parallel_size",
                    f"{who}: tensor_parallel_size {inst.tensor_parallel_size} does not fit the model's "
                    f"{spec.q_heads} attention heads and {spec.kv_heads} KV heads; allowed sizes: "
                    f"{', '.join(map(str, allowed))} (the heads must divide by TP, and the KV heads by TP, or TP by "
                    f"the KV heads when TP is larger)"))
    var = _LONG_LEN_ENV[inst.engine]
    allow = {**dep.env, **inst.env}.get(var, "").strip().lower() in ("1", "true", "yes")
    if spec.max_model_len and inst.max_model_len > spec.max_model_len and not allow:
        out.append(("max_model_len",
                    f"{who}: max_model_len {inst.max_model_len} exceeds the model's context limit of "
                    f"{spec.max_model_len} tokens (max_position_embeddings of its config.json); the engine refuses "
                    f"it (set {var}=1 in env to force it, at the risk of wrong outputs)"))
    return out


def merged_settings(launch: dict, own: Optional[str]) -> Optional[dict]:
    """An engine backend's JSON settings as launch runs it: ``launch`` (what launch fills in: its secret, bind host,
    router keys) with the keys of the instance's own value ``own`` (``DLMIX_SGLANG_CONFIG`` /
    ``DLMIX_LMDEPLOY_CONFIG`` in its ``env``) merged over them, the file's keys winning (set as a whole variable
    instead, the instance's value would replace the secret both sides share). ``launch`` when ``own`` is empty;
    None when ``own`` is not a JSON object."""
    if not own:
        return launch
    try:
        mine = json.loads(own)
    except ValueError:
        return None
    return {**launch, **mine} if isinstance(mine, dict) else None


def _cross_checks(dep: Deployment, marks: Dict[Path_, Tuple[int, int]], origin: str) -> None:
    problems: List[str] = []

    def bad(path: Path_, msg: str) -> None:
        line, col = _where(marks, path)
        problems.append(f"{origin}:{line}:{col}: {_fmt(path)}: {msg}")

    ports: Dict[Tuple[str, int], str] = {}
    if dep.router_enabled():
        ports[("*", dep.router.port)] = "router.port"  # type: ignore[union-attr]
    names: Dict[str, int] = {}
    roles = [i.role for i in dep.instances]
    shapes: Dict[str, Any] = {}  # model reference -> ModelSpec or None (config not readable here)
    catalog = None
    try:
        from dlmix.hw.profiles import load_catalog

        catalog = load_catalog(dep.router.chips if dep.router else None)
    except Exception as e:  # catalog file problems are reported on router.chips
        if dep.router and dep.router.chips:
            bad(("router", "chips"), f"cannot load chip catalog: {e}")
    for i, inst in enumerate(dep.instances):
        name = dep.instance_name(i)
        if name in names:
            bad(("instances", i, "name"), f"duplicate instance name {name!r} (also instances[{names[name]}])")
        names[name] = i
        if name == "router" or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
            bad(("instances", i, "name"), f"instance name {name!r} cannot be used: it names the log file "
                "LOG_DIR/NAME.log ('/', '\\', '.', '..' are not allowed) and 'router' is the router's own name")
        if inst.engine == "sglang":
            try:
                bp = sglang_bootstrap_port(inst.extra_args)
            except ValueError as e:
                bad(("instances", i, "extra_args"), str(e))
            else:
                if bp is not None and ("*", bp) in ports:
                    bad(("instances", i, "extra_args"), f"--disaggregation-bootstrap-port {bp} is also used by "
                        f"{ports[('*', bp)]}")
        key = ("*", inst.port)
        if key in ports:
            bad(("instances", i, "port"), f"port {inst.port} is also used by {ports[key]}")
        ports[key] = f"instances[{i}].port"
        if inst.engine != "mock" and not dep.model_of(i):
            bad(("instances", i, "model"), "no model: set it here or as the top-level 'model'")
        if inst.engine == "lmdeploy":
            if inst.connector is not None:
                bad(("instances", i, "connector"), "connector is vLLM's --kv-transfer-config; LMDeploy's PD uses "
                    "the DLMix migration backend (settings: env DLMIX_LMDEPLOY_CONFIG)")
            if inst.kv.cache_dtype is not None:
                bad(("instances", i, "kv", "cache_dtype"), "LMDeploy's KV dtype follows --dtype; for int8 or "
                    "int4 KV pass LMDeploy's own --quant-policy 8 or 4 in extra_args (fp8 KV is not moved by the "
                    "DLMix backend)")
        if inst.engine == "sglang":
            if inst.kv.cache_bytes is not None:
                bad(("instances", i, "kv", "cache_bytes"), "SGLang sizes its KV pool in tokens: pass "
                    "--max-total-tokens (and --mem-fraction-static) in extra_args")
            if inst.connector is not None:
                bad(("instances", i, "connector"), "connector is vLLM's --kv-transfer-config; SGLang's PD uses "
                    "the dlmix transfer backend (settings: env DLMIX_SGLANG_CONFIG)")
        if inst.engine in ("sglang", "lmdeploy"):
            # what the engine's backend would refuse at start-up, a minute later (a bad pull_threads, a typo'd key),
            # with what launch fills in itself (dlmix.launch.runner), the file's keys winning
            var = "DLMIX_SGLANG_CONFIG" if inst.engine == "sglang" else "DLMIX_LMDEPLOY_CONFIG"
            own = inst.env.get(var, dep.env.get(var))
            if own:
                if inst.engine == "sglang":
                    from dlmix_sglang.config import load_settings
                else:
                    from dlmix_lmdeploy.config import load_settings
                merged = merged_settings({"shared_secret": "-", "host": inst.host, "public_url": inst.url}, own)
                try:  # not a JSON object (merged None): the backend's loader names the variable and the error
                    load_settings(own if merged is None else merged)
                except ValueError as e:  # DLMixSGLangConfigError / DLMixLMDeployConfigError
                    where = ("instances", i, "env", var) if var in inst.env else ("env", var)
                    bad(where, " ".join(str(e).split()))
        if catalog is not None:
            try:
                catalog.chip(inst.chip)
            except KeyError as e:
                bad(("instances", i, "chip"), str(e.args[0]))
        if inst.device == "cpu" and inst.engine == "vllm":
            bs = inst.kv.block_size
            if bs is not None and bs % 32:
                bad(("instances", i, "kv", "block_size"),
                    f"vLLM CPU needs a block size that is a multiple of 32, got {bs}")
            if inst.devices:
                bad(("instances", i, "devices"), "devices is for accelerators; use cpus to pin a CPU engine")
            if inst.kv.gpu_memory_utilization is not None:
                bad(("instances", i, "kv", "gpu_memory_utilization"), "only for accelerator devices")
        if inst.engine in ("vllm", "sglang"):
            for path, msg in _model_fit(dep, i, shapes):
                bad(("instances", i, path), msg)
        conn = dep.connector_of(i)
        if conn is not None and conn.name == "DLMixConnector" and conn.extra_config:
            # what the engine would refuse at start-up, a minute later (dlmix_vllm.config: typo'd keys, transports)
            from dlmix_vllm.config import DLMixConfigError, parse_settings

            try:  # with what launch fills in itself (dlmix.launch.runner), the file's keys winning
                parse_settings({"shared_secret": "-", "chip_profile": inst.chip, "public_url": inst.url,
                                "host": inst.host, **conn.extra_config})
            except DLMixConfigError as e:
                bad(("instances", i, "connector", "extra_config"), " ".join(str(e).split()))
        if conn is not None and conn.name == "DLMixConnector" and "port" in conn.extra_config:
            cp = conn.extra_config["port"]
            if ("*", cp) in ports:
                bad(("instances", i, "connector", "extra_config", "port"),
                    f"port {cp} is also used by {ports[('*', cp)]}")
            ports[("*", cp)] = f"instances[{i}].connector.extra_config.port"
    if "prefill" in roles or "decode" in roles:
        # a prefill instance pairs with decode and both instances (as the router does)
        pd_engines = sorted({i.engine for i in dep.instances
                             if i.role != "both" or "prefill" in roles})
        from dlmix.router.engines import ENGINES, bridges, can_pair, get_engine  # the engine adapters own their PD flow

        # the mock engine speaks vLLM's protocol
        adapters = {e: get_engine("vllm" if e == "mock" else e) for e in pd_engines}
        p_engines = sorted({i.engine for i in dep.instances if i.role == "prefill"})
        d_engines = sorted({i.engine for i in dep.instances if i.role in ("decode", "both")})
        unpaired = [(pe, de) for pe in p_engines for de in d_engines if not can_pair(adapters[pe], adapters[de])]
        if unpaired:
            bad(("instances",), "; ".join(
                f"a {pe} prefill cannot feed a {de} decode" for pe, de in unpaired)
                + ": their PD flows differ (vLLM hands off kv_transfer_params after the prefill, SGLang a bootstrap "
                "room before it, LMDeploy a migration_request after it) and no bridge joins them (bridges: "
                + ", ".join(f"{a} -> {b}" for a, b in sorted(bridges.BRIDGES)) + ")")
        needy = sorted({i.engine for i in dep.instances
                        if i.role == "decode" and adapters[i.engine].DECODE_NEEDS_PREFILL})
        if "decode" in roles and "prefill" not in roles:
            for de in needy:  # named by the decode's own engine, with every engine whose prefill can feed it
                name = {"sglang": "SGLang", "lmdeploy": "LMDeploy"}.get(de, de)
                feeders = [e for e in sorted(ENGINES) if can_pair(get_engine(e), adapters[de])]
                bad(("instances",), f"an {name} decode instance needs a prefill instance (role: prefill; engine "
                                    f"{' or '.join(feeders)}): it cannot compute a prompt itself")
        if "prefill" in roles and "decode" not in roles:
            bad(("instances",), "a prefill instance needs at least one decode instance")
        if "decode" in roles and "prefill" not in roles and "both" not in roles and not needy:
            bad(("instances",), "a decode instance needs a prefill (or both) instance")
        if not dep.router_enabled():
            bad(("router",), "prefill/decode instances need the router (add a 'router:' section)")
    if dep.router is not None and dep.router.enabled:
        from dlmix.routing.policies import POLICIES, make_policy

        # what the router itself refuses at start-up (dlmix.router.server.Router), with the policy it will run:
        # router.config's keys win over router.policy/policy_params in the router.yaml launch writes (runner.plan)
        over = {k.replace("-", "_"): k for k in dep.router.config}
        policy, ppath = dep.router.policy, ("router", "policy")
        params, qpath = dep.router.policy_params, ("router", "policy_params")
        if "policy" in over:
            policy, ppath = dep.router.config[over["policy"]], ("router", "config", over["policy"])
        if "policy_params" in over:
            params, qpath = dep.router.config[over["policy_params"]], ("router", "config", over["policy_params"])
        try:
            if not isinstance(policy, str):
                raise ValueError(f"a policy name is expected, got {policy!r}")
            POLICIES.serving_class(policy)
        except ValueError as e:
            bad(ppath, str(e))
        else:
            try:
                if not isinstance(params, dict):
                    raise ValueError(f"a mapping of policy parameters is expected, got {params!r}")
                make_policy(policy, **dict(params))
            except ValueError as e:  # PolicyParamError: names the parameter and the valid ones
                bad(qpath, str(e))
        if dep.router.config:
            from dlmix.router.config import RouterConfig

            try:
                RouterConfig.from_dict(dict(dep.router.config))
            except _BaseConfigError as e:  # an unknown key (with the known ones) or a bad value
                bad(("router", "config"), str(e.args[0]) if e.args else str(e))
    if problems:
        raise ConfigError(problems)
