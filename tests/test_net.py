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


@pytest.mark.parametrize("host", ["127.1", "2130706433", "0x7f000001", "0177.0.0.1", "::ffff:127.0.0.1",
                                  "[::ffff:127.0.0.1]", "LOCALHOST"])
def test_every_spelling_the_resolver_takes_for_loopback_is_loopback(host):
    """A server bound to ``127.1`` listens on 127.0.0.1, and a dual-stack listener sees a local IPv4 peer as
    ``::ffff:127.0.0.1``: each is loopback, one predicate for the router and the adapters (before: False, so a
    local peer of a dual-stack SGLang hand-off server was refused as remote)."""
    assert is_loopback(host)


@pytest.mark.parametrize("host,want", [("127.1", "127.0.0.1"), ("2130706433", "127.0.0.1"), ("[fe80::1%eth0]", "fe80::1"),
                                       ("::ffff:10.0.0.1", "10.0.0.1"), ("0", "0.0.0.0"), ("example.com", None),
                                       ("deadbeef.com", None), ("", None), ("1.2.3.4:80", None), ("999.1.1.1", None)])
def test_ip_literal(host, want):
    from dlmix.net import ip_literal

    got = ip_literal(host)
    assert (None if got is None else str(got)) == want


@pytest.mark.parametrize("host", ["localhost.", "ip6-localhost.", "LOCALHOST."])
def test_a_loopback_name_with_the_root_dot_needs_dns_and_is_not_loopback(host):
    """glibc's ``files`` source (``/etc/hosts``) does not match ``localhost.``: the name goes to DNS, whose answer
    this predicate cannot vouch for (``getent hosts localhost.`` fails where ``getent hosts localhost`` answers
    127.0.0.1). A settings check that let ``host: localhost.`` listen without a secret would trust that answer."""
    assert not is_loopback(host)
