"""Code mode's pure parts: the upstream config and the per-session policy."""

from __future__ import annotations

from typing import Any

import pytest

from mcp_forge.errors import InvalidRequest, InvalidSession
from mcp_forge.gateway.codemode.policy import Meter, ServerPolicy, policies_of
from mcp_forge.gateway.codemode.upstream import (
    SCHEMA_MAX,
    argument_problem,
    parse_config,
    schema_validator,
)

READ = {"name": "read_file", "annotations": {"readOnlyHint": True}}
WRITE = {"name": "write_file", "annotations": {"destructiveHint": True}}


def test_the_mcp_servers_format_clients_use_is_read() -> None:
    servers = parse_config(
        {
            "mcpServers": {
                "time": {"command": "mcp-server-time", "args": ["--x"], "env": {"A": "1"}},
                "remote": {"url": "https://h.example/mcp", "headers": {"Authorization": "B t"}},
            }
        }
    )
    assert servers["time"].transport == "stdio"
    assert servers["time"].args == ("--x",) and dict(servers["time"].env) == {"A": "1"}
    assert servers["remote"].transport == "http"
    assert dict(servers["remote"].headers) == {"Authorization": "B t"}


def test_isolation_defaults_to_client_for_stdio_and_shared_for_http() -> None:
    servers = parse_config(
        {
            "mcpServers": {
                "local": {"command": "x"},
                "remote": {"url": "https://h.example/mcp"},
                "mine": {"command": "x", "isolation": "session"},
                "everyone": {"command": "x", "isolation": "shared"},
            }
        }
    )
    got = {name: config.isolation for name, config in servers.items()}
    assert got == {"local": "client", "remote": "shared", "mine": "session", "everyone": "shared"}


@pytest.mark.parametrize(
    ("doc", "words"),
    [
        ({}, "mcpServers"),
        ({"mcpServers": {"a": {}}}, "either command (stdio) or url"),
        ({"mcpServers": {"a": {"command": "x", "url": "http://h"}}}, "either command"),
        ({"mcpServers": {"a": {"command": "x", "args": "-v"}}}, "mcpServers.a.args"),
        ({"mcpServers": {"a": {"command": "x", "env": {"A": 1}}}}, "mcpServers.a.env"),
        ({"mcpServers": {"a": {"url": "ftp://h"}}}, "mcpServers.a.url"),
        ({"mcpServers": {"a": {"command": "x", "bogus": 1}}}, "unknown field(s) bogus"),
        ({"mcpServers": {"bad name": {"command": "x"}}}, "mcpServers.bad name"),
        ({"mcpServers": {"a": {"command": "x", "isolation": "pod"}}}, "a.isolation must be one"),
        ({"mcpServers": {"a": {"command": "x", "isolation": ["session"]}}}, "a.isolation"),
    ],
)
def test_a_bad_mcp_config_names_what_is_wrong(doc: dict[str, Any], words: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        parse_config(doc)
    assert words in str(err.value)


def test_allow_deny_and_read_only() -> None:
    assert ServerPolicy("f").refusal(WRITE) is None
    only_read = ServerPolicy("f", allow=("read_*",))
    assert only_read.refusal(READ) is None
    assert "not in the session's allowed tools" in (only_read.refusal(WRITE) or "")
    denied = ServerPolicy("f", deny=("*_file",))
    assert "denied" in (denied.refusal(READ) or "")
    read_only = ServerPolicy("f", read_only=True)
    assert read_only.refusal(READ) is None
    assert "read-only" in (read_only.refusal(WRITE) or "")


def test_policies_come_from_the_spec_and_bad_ones_name_the_field() -> None:
    got = policies_of([{"name": "files", "readOnly": True, "callsPerExecution": 3}])
    assert got["files"].read_only and got["files"].calls_per_execution == 3
    bad: list[tuple[dict[str, Any], str]] = [
        ({"name": "f", "allow": "x"}, "spec.mcpServers[0].allow"),
        ({"name": "f", "readOnly": "yes"}, "spec.mcpServers[0].readOnly"),
        ({"name": "f", "callsPerMinute": 0}, "spec.mcpServers[0].callsPerMinute"),
        ({"name": "f", "extra": 1}, "spec.mcpServers[0]"),
    ]
    for raw, field in bad:
        with pytest.raises(InvalidSession) as err:
            policies_of([raw])
        assert err.value.field == field


def test_the_budget_is_per_execution_and_the_rate_per_minute() -> None:
    meter = Meter()
    budget = ServerPolicy("f", calls_per_execution=2)
    assert meter.take(budget) is None and meter.take(budget) is None
    assert "budget of 2 calls" in (meter.take(budget) or "")
    meter.new_execution()
    assert meter.take(budget) is None
    rate = ServerPolicy("g", calls_per_minute=2)
    assert meter.take(rate, now=0.0) is None and meter.take(rate, now=1.0) is None
    assert "rate limit of 2 calls" in (meter.take(rate, now=2.0) or "")
    assert meter.take(rate, now=60.5) is None  # the first call left the window


ECHO_SCHEMA = {
    "type": "object",
    "properties": {"text": {"type": "string"}, "n": {"type": "integer"}},
    "required": ["text"],
}


def problem(schema: Any, arguments: dict[str, Any]) -> str | None:
    checker = schema_validator(schema)
    if isinstance(checker, str):
        return "schema: " + checker
    return argument_problem(checker, arguments, "s.t")


def test_arguments_are_checked_against_the_input_schema() -> None:
    assert problem(ECHO_SCHEMA, {"text": "hi", "n": 3}) is None
    assert "'smuggled' was unexpected" in (problem(ECHO_SCHEMA, {"text": "", "smuggled": 1}) or "")
    assert "$.n" in (problem(ECHO_SCHEMA, {"text": "", "n": "3"}) or "")
    assert "'text' is a required property" in (problem(ECHO_SCHEMA, {}) or "")
    # A tool without parameters takes no arguments at all.
    assert "unexpected" in (problem({"type": "object", "properties": {}}, {"x": 1}) or "")


@pytest.mark.parametrize(
    "schema",
    [
        {**ECHO_SCHEMA, "additionalProperties": True},
        {**ECHO_SCHEMA, "additionalProperties": {"type": "integer"}},
        {**ECHO_SCHEMA, "patternProperties": {"^x_": {}}},
        {"allOf": [ECHO_SCHEMA]},  # composed: the parts decide, not a closed top level
    ],
)
def test_unknown_fields_pass_only_where_the_schema_allows_them(schema: dict[str, Any]) -> None:
    assert problem(schema, {"text": "hi", "x_extra": 7}) is None


@pytest.mark.parametrize(
    ("schema", "words"),
    [
        ({"type": "object", "properties": {"a": {"type": "no-such-type"}}}, "schema is invalid"),
        ({"type": "object", "properties": {"a": {"minLength": -1}}}, "schema is invalid"),
        ({"type": "object", "properties": {"a": {"type": "string"}}, "x": "y" * SCHEMA_MAX},
         "over the limit"),
        ([1, 2], "not a JSON object"),
        ({"type": "object", "properties": {"a": {"$ref": "https://example.invalid/s.json"}}},
         "cannot be checked"),
    ],
)  # fmt: skip
def test_a_schema_that_is_invalid_huge_or_unresolvable_refuses_calls(
    schema: Any, words: str
) -> None:
    assert words in (problem(schema, {"a": "x"}) or "")


def test_deep_arguments_under_a_recursive_schema_are_refused_not_a_crash() -> None:
    tree = {"type": "object", "properties": {"child": {"$ref": "#"}}}
    deep: dict[str, Any] = {}
    for _ in range(5000):
        deep = {"child": deep}
    assert problem(tree, {"child": {"child": {}}}) is None
    assert "cannot be checked" in (problem(tree, deep) or "")
