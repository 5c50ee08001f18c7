"""Router configuration: YAML + flags (every key also a flag), clear errors."""
from __future__ import annotations

import pytest

from dlmix.router.config import ConfigError, RouterConfig, parse_kv_list


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
