"""The egress policy's decisions (api/egress.py): rules parsed with errors that name the
field, and the verdicts the proxy will act on, each with its reason."""

from __future__ import annotations

import ipaddress

import pytest

from mcp_forge.api.egress import (
    RULES_MAX,
    check_address,
    check_connect,
    check_request,
    check_sni,
    injections,
    normalize_host,
    parse_rules,
    permitted,
)
from mcp_forge.errors import InvalidSession

RULES = parse_rules(
    [
        {"host": "pypi.org"},
        {"host": "*.pythonhosted.org"},
        {"host": "API.Example.com.", "ports": [443, 8443], "methods": ["GET"], "paths": ["/v1/"]},
        {"host": "plain.example.net", "ports": [80], "paths": ["/data"]},
        {"host": "intranet.example.org", "addresses": ["10.1.2.0/24"]},
    ]
)


def test_rules_are_normalized_and_defaulted() -> None:
    assert [r.host for r in RULES] == [
        "pypi.org",
        "*.pythonhosted.org",
        "api.example.com",
        "plain.example.net",
        "intranet.example.org",
    ]
    assert RULES[0].ports == (443,) and not RULES[0].reads_requests
    assert RULES[2].ports == (443, 8443) and RULES[2].reads_requests
    assert parse_rules([{"host": "XN--bcher-kva.example"}])[0].host == "xn--bcher-kva.example"
    assert parse_rules(None) == ()


@pytest.mark.parametrize(
    ("raw", "field", "words"),
    [
        ({"host": "10.0.0.1"}, "[0].host", "'10.0.0.1': an IP address"),
        ({"host": "[::1]"}, "[0].host", "an IP address"),
        ({"host": "*.com"}, "[0].host", "too broad"),
        ({"host": "a*.example.com"}, "[0].host", "label 'a*'"),
        ({"host": "*.*.example.com"}, "[0].host", "'*.*.example.com': label '*'"),
        ({"host": "exa mple.com"}, "[0].host", "label 'exa mple'"),
        ({"host": "bücher.example"}, "[0].host", "not ASCII: write the name's A-label"),
        ({"host": "faß.de"}, "[0].host", "not ASCII"),  # IDNA 2003 and 2008 differ on it
        ({"host": " pypi.org"}, "[0].host", "label ' pypi'"),
        ({"host": "files\n.example.com"}, "[0].host", "label 'files\\n'"),
        ({"host": "2130706433"}, "[0].host", "ends in a number"),
        ({"host": "127.1"}, "[0].host", "ends in a number"),
        ({"host": "0x7f.1"}, "[0].host", "ends in a number"),
        ({"host": "10.0.0.1."}, "[0].host", "ends in a number"),
        ({"host": "x.0x7f"}, "[0].host", "ends in a number"),
        ({"host": "-x.example.com"}, "[0].host", "label '-x'"),
        ({"host": "a" * 64 + ".com"}, "[0].host", "1 to 63"),
        ({"host": ""}, "[0].host", "required"),
        ({}, "[0].host", "required"),
        ({"host": "x.example.com", "ports": [0]}, "[0].ports", "0 is not a port"),
        ({"host": "x.example.com", "ports": [70000]}, "[0].ports", "not a port"),
        ({"host": "x.example.com", "ports": ["443"]}, "[0].ports", "not a port"),
        ({"host": "x.example.com", "ports": [True]}, "[0].ports", "not a port"),
        ({"host": "x.example.com", "ports": []}, "[0].ports", "non-empty"),
        ({"host": "x.example.com", "methods": ["get"]}, "[0].methods", "'get' is not one of"),
        ({"host": "x.example.com", "paths": ["v1"]}, "[0].paths", "starting with '/'"),
        ({"host": "x.example.com", "paths": ["/v1/../admin"]}, "[0].paths", "'..' segment"),
        ({"host": "x.example.com", "paths": ["/%2E%2e/"]}, "[0].paths", "a plain path"),
        ({"host": "x.example.com", "paths": ["/a?b"]}, "[0].paths", "a plain path"),
        ({"host": "x.example.com", "paths": ["/a;b/"]}, "[0].paths", "a plain path"),
        ({"host": "x.example.com", "paths": ["/données/"]}, "[0].paths", "a plain path"),
        ({"host": "x.example.com", "addresses": ["0.0.0.0/0"]}, "[0].addresses", "overlaps"),
        ({"host": "x.example.com", "addresses": ["::/0"]}, "[0].addresses", "overlaps"),
        ({"host": "x.example.com", "addresses": ["127.0.0.1/32"]}, "[0].addresses", "loopback"),
        ({"host": "x.example.com", "addresses": ["169.254.0.0/24"]}, "[0].addresses", "metadata"),
        ({"host": "x.example.com", "addresses": ["10.1.2.3/8"]}, "[0].addresses", "range"),
        ({"host": "x.example.com", "header": "x"}, "[0]", "unknown field 'header'"),
        ("x.example.com", "[0]", "an object with a host"),
    ],
)
def test_a_bad_rule_is_refused_naming_its_field(raw: object, field: str, words: str) -> None:
    with pytest.raises(InvalidSession) as caught:
        parse_rules([raw])
    assert caught.value.field == f"spec.network.allow{field}"
    assert words in str(caught.value)


def test_too_many_rules_are_refused() -> None:
    with pytest.raises(InvalidSession, match=f"at most {RULES_MAX}"):
        parse_rules([{"host": f"h{i}.example.com"} for i in range(RULES_MAX + 1)])
    with pytest.raises(InvalidSession, match="a list"):
        parse_rules({"host": "x.example.com"})


@pytest.mark.parametrize(
    ("host", "port", "allowed", "words"),
    [
        ("pypi.org", 443, True, "rule 1 (pypi.org)"),
        ("PyPI.org.", 443, True, "rule 1"),
        ("pypi.org", 80, False, "no rule allows pypi.org on port 80"),
        ("files.pythonhosted.org", 443, True, "rule 2 (*.pythonhosted.org)"),
        ("a.b.pythonhosted.org", 443, True, "rule 2"),
        ("pythonhosted.org", 443, False, "no rule allows"),  # a wildcard is not its apex
        ("evilpythonhosted.org", 443, False, "no rule allows"),
        ("pypi.org.evil.net", 443, False, "no rule allows"),
        ("xpypi.org", 443, False, "no rule allows"),
        ("151.101.0.223", 443, False, "an IP address, not a host name"),
        ("[2a04:4e42::223]", 443, False, "an IP address"),
        ("bad_name.org", 443, False, "label 'bad_name'"),
        ("files\n.pythonhosted.org", 443, False, "label 'files\\n'"),
        ("straße.example", 443, False, "not ASCII"),
        ("10.0.0.1.", 443, False, "an IP address"),
        ("0x7f.1", 443, False, "ends in a number"),
    ],
)
def test_a_tunnel_is_allowed_by_name_and_port_only(
    host: str, port: int, allowed: bool, words: str
) -> None:
    verdict = check_connect(RULES, host, port)
    assert verdict.allowed is allowed and not verdict.inspect
    assert words in verdict.reason


def test_a_tunnel_that_only_request_rules_allow_must_be_read() -> None:
    verdict = check_connect(RULES, "api.example.com", 8443)
    assert verdict.allowed and verdict.inspect
    assert verdict.rule is RULES[2]
    assert "if its requests are read" in verdict.reason


@pytest.mark.parametrize(
    ("host", "port", "method", "path", "allowed", "words"),
    [
        ("api.example.com", 443, "GET", "/v1/items?x=1", True, "rule 3"),
        ("api.example.com", 443, "POST", "/v1/items", False, "method POST is not one of GET"),
        ("api.example.com", 443, "GET", "/v2/items", False, "under none of /v1/"),
        ("api.example.com", 443, "GET", "/v1/../admin", False, "not a plain path"),
        ("api.example.com", 443, "GET", "/v1/%2e%2e/admin", False, "not a plain path"),
        ("api.example.com", 443, "GET", "/v1/..%2fadmin", False, "not a plain path"),
        ("api.example.com", 443, "GET", "/v1/..;/admin", False, "not a plain path"),
        ("api.example.com", 443, "GET", "/v1/#/../admin", False, "not a plain path"),
        ("api.example.com", 443, "GET", "/v1/%252e%252e/admin", False, "not a plain path"),
        ("api.example.com", 443, "GET", "/v1/%c0%ae%c0%ae/admin", False, "not a plain path"),
        ("api.example.com", 443, "GET", "/v1/\uff0e\uff0e/admin", False, "not a plain path"),
        ("api.example.com", 443, "GET", "/v1/a%20b", False, "not a plain path"),
        ("api.example.com", 443, "GET", "/v1/%61bc", True, "rule 3"),  # decoded once: /v1/abc
        ("api.example.com", 443, "GET", "/v%31/abc", True, "rule 3"),
        ("plain.example.net", 80, "GET", "/data", True, "rule 4"),
        ("plain.example.net", 80, "DELETE", "/data/x", True, "rule 4"),  # any method
        ("plain.example.net", 80, "GET", "/database", False, "under none of /data"),
        ("plain.example.net", 443, "GET", "/data", False, "no rule allows"),
        ("pypi.org", 443, "POST", "/anything", True, "rule 1"),
    ],
)
def test_a_request_is_held_to_its_rules_methods_and_paths(
    host: str, port: int, method: str, path: str, allowed: bool, words: str
) -> None:
    verdict = check_request(RULES, host, port, method, path)
    assert verdict.allowed is allowed, verdict.reason
    assert words in verdict.reason


@pytest.mark.parametrize(
    ("host", "sni", "allowed"),
    [
        ("pypi.org", "pypi.org", True),
        ("pypi.org", "PYPI.org.", True),
        ("pypi.org", None, True),
        ("pypi.org", "evil.example.com", False),  # domain fronting
        ("pypi.org", "127.0.0.1", False),
    ],
)
def test_the_tls_server_name_must_be_the_connect_host(
    host: str, sni: str | None, allowed: bool
) -> None:
    assert check_sni(host, sni).allowed is allowed


@pytest.mark.parametrize(
    ("address", "words"),
    [
        ("127.0.0.1", "loopback"),
        ("127.1.2.3", "loopback"),
        ("::1", "loopback"),
        ("::ffff:127.0.0.1", "loopback"),  # IPv4 inside IPv6 is judged as itself
        ("64:ff9b::a00:1", "private"),  # NAT64 to 10.0.0.1
        ("64:ff9b::a9fe:a9fe", "link-local"),  # NAT64 to the metadata address
        ("2002:7f00:1::", "loopback"),  # 6to4 of 127.0.0.1
        ("2001:0:4136:e378:8000:63bf:f5ff:fffe", "private"),  # Teredo, client 10.0.0.1
        ("10.0.0.5", "private"),
        ("172.16.3.4", "private"),
        ("192.168.1.1", "private"),
        ("fd00::1", "private"),
        ("169.254.169.254", "link-local"),  # the cloud metadata address
        ("fe80::1", "link-local"),
        ("0.0.0.0", "unspecified"),
        ("100.64.0.1", "reserved"),  # shared address space: not global
        ("224.0.0.1", "multicast"),
        ("240.0.0.1", "reserved"),
        ("192.0.0.8", "not a public address"),
        ("192.88.99.1", "not a public address"),
        ("::127.0.0.1", "a form we refuse"),  # IPv4-compatible
        ("::169.254.169.254", "a form we refuse"),
        ("::ffff:0:127.0.0.1", "a form we refuse"),  # SIIT
        ("64:ff9b:1::a00:1", "a form we refuse"),  # local-use NAT64
        ("fec0::1", "not a public address"),  # site-local
        ("5f00::1", "not a public address"),
        ("3fff::1", "not a public address"),  # documentation
        ("2001:db8::1", "not a public address"),
        ("not-an-address", "is not an address"),
    ],
)
def test_names_resolving_inward_are_refused(address: str, words: str) -> None:
    verdict = check_address(address, RULES[0])
    assert not verdict.allowed
    assert words in verdict.reason


def test_a_public_address_passes_and_the_cluster_and_listed_ranges_decide() -> None:
    assert check_address("151.101.0.223", RULES[0]).allowed
    assert check_address("64:ff9b::9765:df", RULES[0]).allowed  # NAT64 to that address
    cluster = [ipaddress.ip_network("151.101.0.0/16")]
    inside = check_address("151.101.0.223", RULES[0], cluster=cluster)
    assert not inside.allowed and "cluster's own range 151.101.0.0/16" in inside.reason
    assert check_address("10.1.2.3", RULES[4]).allowed  # the rule lists its range
    assert not check_address("10.1.3.3", RULES[4]).allowed
    assert not check_address("10.1.2.3", RULES[0]).allowed  # another rule's range is not his


def test_host_names_normalize_one_way() -> None:
    assert normalize_host("Files.PythonHosted.org.") == "files.pythonhosted.org"
    with pytest.raises(ValueError, match="an IP address"):
        normalize_host("[::1]")


REF = {"secretKeyRef": {"name": "api", "key": "token"}}


def test_values_added_on_the_way_out_are_parsed_and_make_the_tunnel_read() -> None:
    (rule,) = parse_rules(
        [
            {
                "host": "api.example.com",
                "inject": [
                    {"header": "Authorization", "prefix": "Bearer ", **REF},
                    {"query": "api_key", **REF},
                    {"basicAuth": "alice", **REF},
                ],
            }
        ]
    )
    assert [(i.kind, i.name, i.prefix) for i in rule.inject] == [
        ("header", "Authorization", "Bearer "),
        ("query", "api_key", ""),
        ("basicAuth", "alice", ""),
    ]
    assert rule.inject[0].secret == "api" and rule.inject[0].key == "token"
    verdict = check_connect([rule], "api.example.com", 443)
    assert verdict.allowed and verdict.inspect and verdict.rule == rule
    assert injections([rule], "api.example.com", 443, "GET", "/") == rule
    assert injections([rule], "other.example.com", 443, "GET", "/") is None


def test_a_rule_that_adds_values_is_read_even_beside_one_that_would_not() -> None:
    rules = parse_rules(
        [
            {"host": "api.example.com"},
            {"host": "api.example.com", "inject": [{"header": "X-K", **REF}]},
        ]
    )
    verdict = check_connect(rules, "api.example.com", 443)
    assert verdict.inspect and verdict.rule == rules[1]


@pytest.mark.parametrize(
    ("inject", "field", "words"),
    [
        ([{"header": "Host", **REF}], "inject[0].header", "the proxy's to set"),
        ([{"header": "Proxy-Authorization", **REF}], "inject[0].header", "the proxy's to set"),
        ([{"header": "X\r\nY", **REF}], "inject[0].header", "not a header name"),
        ([{"header": "X", "query": "y", **REF}], "inject[0]", "exactly one of"),
        ([{**REF}], "inject[0]", "exactly one of"),
        ([{"query": "k", "prefix": "x", **REF}], "inject[0].prefix", "header only"),
        ([{"header": "X", "prefix": "a\nb", **REF}], "inject[0].prefix", "printable"),
        ([{"basicAuth": "a:b", **REF}], "inject[0].basicAuth", "not a user name"),
        ([{"header": "X", "secretKeyRef": {"name": "a"}}], "inject[0].secretKeyRef", "name and"),
        ([{"header": "X", "secretKeyRef": {"name": "a/b", "key": "k"}}], "secretKeyRef", "name"),
        ([{"header": "X", "value": "v", **REF}], "inject[0]", "unknown field 'value'"),
        ([], "inject", "1 to 4"),
        ([{"header": f"X{i}", **REF} for i in range(5)], "inject", "1 to 4"),
    ],
)
def test_a_bad_value_to_add_is_refused_naming_its_field(
    inject: list[object], field: str, words: str
) -> None:
    with pytest.raises(InvalidSession, match=words) as raised:
        parse_rules([{"host": "api.example.com", "inject": inject}])
    assert raised.value.field is not None and raised.value.field.endswith(field), raised.value.field


OFFERED = parse_rules(
    [
        {"host": "pypi.org"},
        {"host": "*.example.com", "ports": [443, 8443]},
        {"host": "api.example.net", "methods": ["GET"], "paths": ["/v1/"]},
    ]
)


@pytest.mark.parametrize(
    "asked",
    [
        {"host": "pypi.org"},
        {"host": "PyPI.org."},
        {"host": "a.example.com", "ports": [8443]},
        {"host": "*.sub.example.com"},
        {"host": "*.example.com", "ports": [443, 8443]},
        {"host": "api.example.net", "methods": ["GET"], "paths": ["/v1/items"]},
    ],
)
def test_a_client_may_ask_for_what_is_offered_or_less(asked: dict[str, object]) -> None:
    permitted(parse_rules([asked], field="allow"), OFFERED)


@pytest.mark.parametrize(
    ("asked", "words"),
    [
        ({"host": "files.pythonhosted.org"}, "not among"),
        ({"host": "example.com"}, "not among"),  # the apex is not under *.example.com
        ({"host": "pypi.org", "ports": [80]}, "not among"),
        ({"host": "a.example.com", "ports": [22]}, "not among"),
        ({"host": "api.example.net"}, "not among"),  # any method, any path: more than offered
        ({"host": "api.example.net", "methods": ["POST"], "paths": ["/v1/"]}, "not among"),
        ({"host": "api.example.net", "methods": ["GET"], "paths": ["/admin/"]}, "not among"),
        ({"host": "pypi.org", "addresses": ["10.0.0.0/8"]}, "addresses is the operator's"),
        (
            {
                "host": "pypi.org",
                "inject": [{"header": "X", "secretKeyRef": {"name": "a", "key": "b"}}],
            },
            "inject is the operator's",
        ),
    ],
)
def test_a_client_asking_for_more_is_refused_naming_the_rule(
    asked: dict[str, object], words: str
) -> None:
    with pytest.raises(InvalidSession, match=words) as raised:
        permitted(parse_rules([asked], field="allow"), OFFERED)
    assert raised.value.field is not None and raised.value.field.startswith("allow[0]")


def test_nothing_offered_nothing_permitted() -> None:
    with pytest.raises(InvalidSession, match=r"\(none\)"):
        permitted(parse_rules([{"host": "pypi.org"}], field="allow"), ())
