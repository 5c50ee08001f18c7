"""dlmix.net.is_loopback: the one loopback predicate of the router and the engine adapters' settings."""
import pytest

from dlmix.net import is_loopback


@pytest.mark.parametrize("host", ["127.0.0.1", "127.8.9.10", "::1", "[::1]", "localhost", "ip6-localhost"])
def test_loopback_hosts(host):
    assert is_loopback(host)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.0.0.1", "192.168.1.1", "example.com", "localhost.evil.com",
                                  "", "127.0.0.1:80"])
def test_other_hosts_are_not_loopback(host):
    assert not is_loopback(host)
