"""Router configuration: YAML + flags (every key also a flag), clear errors."""
from __future__ import annotations

import dataclasses
import re

import pytest
from typer.testing import CliRunner

from dlmix.router.config import FLAG_ALIASES, KEY_HELP, ConfigError, RouterConfig, parse_kv_list

ALIASES = {"--instance": "instances", "--policy-param": "policy_params", "--chip": "chips", "--api-key": "api_keys",
           "--etcd": "etcd_endpoints"}


def _schema_flags() -> list:
    """Every config key as a flag, each followed by its aliases (the order --help uses)."""
    out = []
    for f in dataclasses.fields(RouterConfig):
        out.append("--" + f.name.replace("_", "-"))
        out += [a for a, k in ALIASES.items() if k == f.name]
    return out


def test_yaml_then_flags(tmp_path):
    f = tmp_path / "router.yaml"
    f.write_text("port: 9000\npolicy: prefix\npolicy_params: {cache_threshold: 0.5}\n"
                 "instances:\n  - {url: 'http://a:1', role: prefill, chip: H100}\n")
    cfg = RouterConfig.from_yaml(f).apply_flags([
        "--port", "9100", "--policy-param", "balance_abs_threshold=3", "--instance",
        "url=http://b:2,role=decode,chip=H20,transport.link=rdma-100g,kv_events=tcp://b:5557",
        "--health-interval-s=0.5", "--metrics", "false", "--api-keys", "k1"])
    assert cfg.port == 9100 and cfg.policy == "prefix" and cfg.health_interval_s == 0.5 and cfg.metrics is False
    assert cfg.policy_params == {"cache_threshold": 0.5, "balance_abs_threshold": 3}
    assert cfg.instances[1] == {"url": "http://b:2", "role": "decode", "chip": "H20",
                                "transport": {"link": "rdma-100g"}, "kv_events": "tcp://b:5557"}
    assert cfg.api_keys == ["k1"]


def test_errors(tmp_path):
    with pytest.raises(ConfigError, match="unknown flag --nope"):
        RouterConfig().apply_flags(["--nope", "1"])
    with pytest.raises(ConfigError, match="expected int"):
        RouterConfig().apply_flags(["--port", "abc"])
    f = tmp_path / "bad.yaml"
    f.write_text("polcy: cost\n")
    with pytest.raises(ConfigError, match="unknown router config key"):
        RouterConfig.from_yaml(f)
    with pytest.raises(ConfigError, match="key=value"):
        parse_kv_list("url=http://a:1,oops")


def test_every_key_has_a_one_line_description_and_the_aliases_are_the_documented_ones():
    assert list(KEY_HELP) == [f.name for f in dataclasses.fields(RouterConfig)]
    assert all(v and "\n" not in v for v in KEY_HELP.values())
    assert {"--" + a.replace("_", "-"): k for a, k in FLAG_ALIASES.items()} == ALIASES
    assert RouterConfig.flag_names() == _schema_flags()


def _help() -> str:
    from dlmix.cli import app

    res = CliRunner().invoke(app, ["router", "--help"])
    assert res.exit_code == 0, res.output
    return re.sub(r"\x1b\[[0-9;]*m", "", res.output)


def test_router_help_lists_every_flag_of_the_schema_with_aliases_descriptions_and_defaults():
    text = _help()
    panel = text.split("Config flags (each a router.yaml key; a flag wins over the file)", 1)[1]
    rows = re.findall(r"^  (--[a-z-]+(?:, --[a-z-]+)*) (\S+)", panel, re.M)
    listed = [n for names, _ in rows for n in names.split(", ")]
    assert listed == _schema_flags()
    assert len(listed) == len(dataclasses.fields(RouterConfig)) + 5
    assert "--config" in text.split("Config flags")[0]  # click's own option, in its own panel
    metavars = {names.split(", ")[0]: mv for names, mv in rows}
    assert metavars["--port"] == "INTEGER" and metavars["--max-body-mb"] == "FLOAT"
    assert metavars["--allow-open"] == "[BOOL]" and metavars["--instances"] == "K=V,..."
    flat = " ".join(ln.strip() for ln in panel.splitlines())
    flat = re.sub(r"\s+", " ", flat)
    assert "port to listen on [default: 8000]" in flat
    assert "--etcd-endpoints, --etcd TEXT etcd endpoint of the fleet's shared state" in flat
    assert "[default: /dlmix/default]" in flat and "[default: false]" in flat


def test_every_listed_flag_and_alias_is_accepted():
    cfg = RouterConfig().apply_flags(["--instance", "url=http://a:1", "--instances", "http://b:2",
                                      "--policy-param", "x=1", "--policy-params", "y=2", "--chip", "c.yaml",
                                      "--api-key", "k1", "--api-keys", "k2", "--etcd", "http://127.0.0.1:2379",
                                      "--allow-open", "--etcd-allow-open", "false", "--max-body-mb=2"])
    assert [i["url"] for i in cfg.instances] == ["http://a:1", "http://b:2"]
    assert cfg.policy_params == {"x": 1, "y": 2} and cfg.chips == ["c.yaml"] and cfg.api_keys == ["k1", "k2"]
    assert cfg.etcd_endpoints == ["http://127.0.0.1:2379"] and cfg.allow_open is True
    assert cfg.etcd_allow_open is False and cfg.max_body_mb == 2.0


def test_unknown_flag_exits_2_listing_every_flag_and_alias():
    from dlmix.cli import app

    res = CliRunner().invoke(app, ["router", "--bogus-flag", "1"])
    assert res.exit_code == 2
    assert res.stderr == ("error: unknown flag --bogus-flag; known: " + ", ".join(_schema_flags())
                          + " (dlmix router --help describes them)\n")
    res = CliRunner().invoke(app, ["router", "--policy-parm", "x=1"])
    assert res.exit_code == 2
    assert res.stderr.startswith("error: unknown flag --policy-parm (did you mean --policy-param?); known: --host, ")
    res = CliRunner().invoke(app, ["router", "--port"])
    assert res.exit_code == 2 and res.stderr == "error: flag --port needs a value\n"


# ---- review 4: numeric keys were not range-checked. `--port 99999` listened on 34463 (the OS takes it modulo 65536)
# while announcing :99999; `--max-body-mb inf` / `--port -5` crashed with OverflowError / gaierror tracebacks;
# `--health-interval-s 0` health-checked every engine back to back (a CPU spin on the router and the engines);
# `--health-interval-s nan`, `--retries -1`, `--connect-timeout-s inf` were accepted
@pytest.mark.parametrize("flag,value", [("--port", "99999"), ("--port", "-5"), ("--port", ".inf"),
                                        ("--max-body-mb", "inf"), ("--max-body-mb", "nan"),
                                        ("--health-interval-s", "0"), ("--health-interval-s", "nan"),
                                        ("--health-timeout-s", "-1"), ("--health-failures", "0"),
                                        ("--retries", "-1"), ("--connect-timeout-s", "inf"),
                                        ("--prefill-timeout-s", "0"), ("--heartbeat-ttl-s", "nan"),
                                        ("--default-block-size", "0"), ("--etcd-timeout-s", "0")])
def test_out_of_range_numbers_are_config_errors_naming_the_key(flag, value):
    from dlmix.router.server import Router

    key = flag[2:].replace("-", "_")
    with pytest.raises(ConfigError, match=f"router config key {key}"):
        Router(RouterConfig().apply_flags([flag, value]))  # constructing listens on nothing


def test_an_infinite_body_limit_exits_2_on_the_cli():
    from dlmix.cli import app

    res = CliRunner().invoke(app, ["router", "--max-body-mb", "inf"])
    assert res.exit_code == 2 and "router config key max_body_mb" in res.stderr, (res.exit_code, res.stderr,
                                                                                  repr(res.exception))


def test_validate_accepts_the_defaults_and_the_documented_edges():
    RouterConfig().validate()
    RouterConfig(port=0, heartbeat_ttl_s=0, retries=0, breaker_cooldown_s=0, metrics_instance_series=0).validate()
    RouterConfig(port=65535).validate()
    with pytest.raises(ConfigError, match="port"):
        RouterConfig(port=65536).validate()
    with pytest.raises(ConfigError, match="retries must be an integer >= 0"):
        RouterConfig(retries=1.5).validate()


def test_router_default_heartbeat_ttl_above_etcds_longest_lease_is_refused():
    """The router's default ``heartbeat_ttl_s`` is bounded like a registration's own (etcd's longest lease): a larger
    one made every registration that names no TTL a 503 with etcd."""
    from dlmix.pd.registration import MAX_HEARTBEAT_TTL_S

    RouterConfig(heartbeat_ttl_s=MAX_HEARTBEAT_TTL_S).validate()
    with pytest.raises(ConfigError, match="heartbeat_ttl_s"):
        RouterConfig(heartbeat_ttl_s=1e12).validate()
