"""Plain JSON-RPC over streamable HTTP, for what the SDK clients do not send (tasks):
an MCP session of protocol 2025-11-25 opened by hand, and requests on it."""

from __future__ import annotations

import json
from typing import Any

import httpx2

TASK_VERSION = "2025-11-25"


def messages(response: httpx2.Response) -> list[dict[str, Any]]:
    """The JSON-RPC messages of a response: a JSON body, or the data of its SSE events."""
    if response.headers.get("content-type", "").startswith("application/json"):
        return [response.json()]
    data = [line[5:] for line in response.text.splitlines() if line.startswith("data:")]
    return [json.loads(d) for d in data if d.strip()]  # not the empty priming events


async def open_session(
    http: httpx2.AsyncClient, url: str, token: str, version: str = TASK_VERSION
) -> dict[str, str]:
    """A new MCP session for `token`, initialized; the headers of its requests."""
    sent = {
        "Accept": "application/json, text/event-stream",
        "Content-Type": "application/json",
        "Authorization": f"Bearer {token}",
    }
    hello = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {
            "protocolVersion": version,
            "capabilities": {},
            "clientInfo": {"name": "raw", "version": "0"},
        },
    }
    r = await http.post(url, headers=sent, json=hello)
    assert r.status_code == 200, r.text
    sent = {**sent, "mcp-session-id": r.headers["mcp-session-id"], "mcp-protocol-version": version}
    note = {"jsonrpc": "2.0", "method": "notifications/initialized"}
    assert (await http.post(url, headers=sent, json=note)).status_code == 202
    return sent


async def rpc(
    http: httpx2.AsyncClient, url: str, sent: dict[str, str], method: str, **params: Any
) -> dict[str, Any]:
    """One request on the session whose headers are `sent`: its answer (result or error)."""
    r = await http.post(
        url, headers=sent, json={"jsonrpc": "2.0", "id": 9, "method": method, "params": params}
    )
    assert r.status_code == 200, r.text
    [answer] = [m for m in messages(r) if m.get("id") == 9]
    return answer


async def task_of(
    http: httpx2.AsyncClient, url: str, sent: dict[str, str], code: str, **args: Any
) -> str:
    """execute_code of `code` as a task (ttl 10 minutes): its id, the task checked."""
    call = await rpc(
        http,
        url,
        sent,
        "tools/call",
        name="execute_code",
        arguments={"code": code, **args},
        task={"ttl": 600_000},
    )
    assert "result" in call, call
    task = call["result"]["task"]
    assert task["status"] == "working" and task["ttl"] == 600_000, call
    assert task["pollInterval"] > 0 and task["createdAt"].endswith("Z"), call
    return str(task["taskId"])


def shown(answer: dict[str, Any]) -> Any:
    """The text/plain of an execute_code answer's result value, if it has one."""
    result = answer.get("result") or {}
    value = (result.get("structuredContent") or {}).get("result") or {}
    return value.get("data", {}).get("text/plain")


MODERN = "2026-07-28"
TASKS_EXTENSION = "io.modelcontextprotocol/tasks"


async def modern(
    http: httpx2.AsyncClient,
    url: str,
    token: str,
    method: str,
    *,
    tasks: bool = True,
    **params: Any,
) -> dict[str, Any]:
    """One 2026-07-28 request (no session: its envelope in `_meta`, its routing in
    headers), declaring the tasks extension if `tasks`; its answer."""
    capabilities: dict[str, Any] = {"extensions": {TASKS_EXTENSION: {}}} if tasks else {}
    meta = {
        "io.modelcontextprotocol/protocolVersion": MODERN,
        "io.modelcontextprotocol/clientCapabilities": capabilities,
        "io.modelcontextprotocol/clientInfo": {"name": "raw", "version": "0"},
    }
    headers = {
        "Accept": "application/json, text/event-stream",
        "Content-Type": "application/json",
        "Authorization": f"Bearer {token}",
        "MCP-Protocol-Version": MODERN,
        "Mcp-Method": method,
    }
    if "name" in params:
        headers["Mcp-Name"] = str(params["name"])
    elif "taskId" in params:
        headers["Mcp-Name"] = str(params["taskId"])  # the extension's routing header
    body = {"jsonrpc": "2.0", "id": 9, "method": method, "params": {**params, "_meta": meta}}
    r = await http.post(url, headers=headers, json=body)
    [answer] = [m for m in messages(r) if m.get("id") == 9]
    return answer
