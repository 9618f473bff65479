"""MCP as the specification has it, on the real gateway over streamable HTTP: the
capabilities each protocol version is told (and served), serverInfo, the running
cell's output through what the negotiated version recommends, and the wire (media
type, batches, no answer to a cancelled request). Plain HTTP where the SDK client would
hide what is on the wire, the official SDK client elsewhere (the initialize handshake
with mode="legacy", 2026-07-28 by its own probe)."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx2
import pytest
from mcp import Client, MCPError
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.subscriptions import ResourceUpdated
from test_http import CALL_DEADLINE, INITIALIZE, HttpGateway, delete_sessions, running_gateway

from mcp_forge import __version__

pytestmark = pytest.mark.podman

HANDSHAKE = ("2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25")
SERVED = {"tools", "resources", "logging"}  # what it serves: nothing else may be declared
HANDSHAKE_SERVED = SERVED | {"tasks"}  # tasks (test_tasks.py): 2026-07-28's is an extension
TICKS = "import time\nfor i in range(2):\n    print('tick', i, flush=True)\n    time.sleep(0.7)"


@pytest.fixture(scope="module")
async def gw(state_dir: Path, tmp_path_factory: Any) -> AsyncIterator[HttpGateway]:
    async with running_gateway(state_dir, tmp_path_factory.mktemp("protocol")) as g:
        yield g
    await delete_sessions(state_dir, None)


@asynccontextmanager
async def client(gw: HttpGateway, name: str = "alice", **options: Any) -> AsyncIterator[Client]:
    """The official SDK client over streamable HTTP with `name`'s token; `options` are
    the Client's (mode, logging_callback, log_level)."""
    http = httpx2.AsyncClient(
        headers={"Authorization": f"Bearer {gw.tokens[name]}"},
        timeout=httpx2.Timeout(30.0, read=CALL_DEADLINE),
    )
    transport = streamable_http_client(gw.url, http_client=http)
    async with http, Client(transport, read_timeout_seconds=CALL_DEADLINE, **options) as c:
        yield c


def messages(response: httpx2.Response) -> list[dict[str, Any]]:
    """The JSON-RPC messages of a response: a JSON body, or the data of its SSE events."""
    if response.headers.get("content-type", "").startswith("application/json"):
        return [response.json()]
    data = [line[5:] for line in response.text.splitlines() if line.startswith("data:")]
    return [json.loads(d) for d in data if d.strip()]  # not the empty priming events


def initialize(version: str) -> dict[str, Any]:
    params: dict[str, Any] = dict(INITIALIZE["params"])  # type: ignore[call-overload]
    return {**INITIALIZE, "params": {**params, "protocolVersion": version}}


@pytest.mark.parametrize("version", HANDSHAKE)
async def test_each_handshake_version_is_told_what_is_served_and_the_version(
    gw: HttpGateway, version: str
) -> None:
    sent = {"Content-Type": "application/json"}
    r = await gw.post(gw.tokens["alice"], headers=sent, content=json.dumps(initialize(version)))
    assert r.status_code == 200, r.text
    [answer] = messages(r)
    result = answer["result"]
    assert result["protocolVersion"] == version
    served = HANDSHAKE_SERVED if version == "2025-11-25" else SERVED
    assert set(result["capabilities"]) == served, result["capabilities"]
    assert (result["serverInfo"]["name"], result["serverInfo"]["version"]) == (
        "mcp-forge",
        __version__,
    )


async def test_the_2026_07_28_probe_is_told_what_is_served(gw: HttpGateway) -> None:
    async with client(gw) as c:
        assert c.protocol_version == "2026-07-28"
        declared = c.server_capabilities.model_dump(exclude_none=True)
        assert set(declared) == SERVED | {"extensions"}, declared
        assert declared["extensions"] == {"io.modelcontextprotocol/tasks": {}}, declared
        assert c.server_info is not None and c.server_info.version == __version__
        with pytest.raises(MCPError) as refused:
            await c.list_prompts()
        assert refused.value.error.code == -32601  # not declared, not served
    async with client(gw, mode="legacy") as c:
        with pytest.raises(MCPError) as refused:
            await c.list_prompts()
        assert refused.value.error.code == -32601


@pytest.mark.parametrize("mode", ["legacy", "auto"])
async def test_a_sessions_files_and_notebook_are_resources_of_its_client_only(
    gw: HttpGateway, mode: str
) -> None:
    code = (
        "open('/workspace/hello.txt', 'w').write('hi there')\n"
        "open('/workspace/blob.bin', 'wb').write(bytes(range(256)))"
    )
    async with client(gw, "alice", mode=mode) as c:
        ran = await c.call_tool("execute_code", {"code": code})
        assert not ran.is_error, ran
        sid = ran.structured_content["session_id"]
        listed = await c.list_resources()
        notebook = f"forge://sessions/{sid}/notebook"
        assert notebook in [str(r.uri) for r in listed.resources], listed
        templates = {t.uri_template for t in (await c.list_resource_templates()).resource_templates}
        assert templates == {
            "forge://sessions/{session_id}/files/{+path}",
            "forge://sessions/{session_id}/notebook",
        }
        [text] = (await c.read_resource(f"forge://sessions/{sid}/files/hello.txt")).contents
        assert getattr(text, "text", None) == "hi there", text
        [blob] = (await c.read_resource(f"forge://sessions/{sid}/files/blob.bin")).contents
        assert base64.b64decode(getattr(blob, "blob", "")) == bytes(range(256)), blob
        [nb] = (await c.read_resource(notebook)).contents
        cells = json.loads(getattr(nb, "text", "{}"))["cells"]
        assert any("hello.txt" in "".join(cell["source"]) for cell in cells), cells
        for missing in ("files/nothing-here", "files/../../etc/passwd"):
            with pytest.raises(MCPError) as refused:
                await c.read_resource(f"forge://sessions/{sid}/{missing}")
            assert refused.value.error.code == -32602, refused.value.error
    async with client(gw, "bob", mode=mode) as other:
        assert notebook not in [str(r.uri) for r in (await other.list_resources()).resources]
        with pytest.raises(MCPError) as refused:
            await other.read_resource(f"forge://sessions/{sid}/files/hello.txt")
        assert refused.value.error.code == -32602
        assert "hi there" not in refused.value.error.message


# mode, logging/setLevel sent (legacy only), the request's opt-in log level (2026-07-28)
# -> the output arrives as log messages, as progress messages
OUTPUT = [
    ("legacy", None, None, True, False),
    ("legacy", "warning", None, False, True),  # the client does not want info logs
    ("auto", None, None, False, True),  # 2026-07-28: logging only on request
    ("auto", None, "info", True, False),
]


@pytest.mark.parametrize(("mode", "set_level", "log_level", "as_log", "as_progress"), OUTPUT)
async def test_a_running_cells_output_arrives_as_the_negotiated_version_recommends(
    gw: HttpGateway,
    mode: str,
    set_level: Any,
    log_level: str | None,
    as_log: bool,
    as_progress: bool,
) -> None:
    logs: list[str] = []
    heard: list[tuple[float, str]] = []

    async def on_log(params: Any) -> None:
        logs.append(str(params.data))

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        heard.append((progress, message or ""))

    options: dict[str, Any] = {"mode": mode, "logging_callback": on_log}
    if log_level is not None:
        options["log_level"] = log_level
    async with client(gw, "bob", **options) as c:
        if set_level is not None:
            await c.set_logging_level(set_level)
        r = await c.call_tool("execute_code", {"code": TICKS}, progress_callback=on_progress)
    assert not r.is_error, r
    said = "".join(message for _, message in heard)
    assert ("tick 0" in "".join(logs)) is as_log, logs
    assert ("tick 0" in said) is as_progress, heard
    assert [v for v, _ in heard] == sorted({v for v, _ in heard})  # strictly rising
    # SEP-2577: the SDK's Context.log warns on every call; the gateway does not use it
    assert not [line for line in gw.log if "eprecat" in line], gw.log


async def test_a_body_that_is_not_json_gets_415(gw: HttpGateway) -> None:
    r = await gw.post(gw.tokens["alice"], headers={"Content-Type": "text/plain"}, content=b"hello")
    assert r.status_code == 415, r.text
    assert r.json()["error"]["code"] == -32600
    assert "application/json" in r.json()["error"]["message"]


async def test_a_batch_gets_invalid_request(gw: HttpGateway) -> None:
    batch = json.dumps([initialize("2025-06-18"), {**initialize("2025-06-18"), "id": 2}])
    r = await gw.post(
        gw.tokens["alice"], headers={"Content-Type": "application/json"}, content=batch
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == -32600
    # and a single message still works
    assert (await gw.post(gw.tokens["alice"])).status_code == 200


async def test_a_cancelled_request_is_not_answered(gw: HttpGateway) -> None:
    """notifications/cancelled: the call's stream ends, with no response to the call."""
    version = "2025-06-18"
    headers = {
        "Authorization": f"Bearer {gw.tokens['alice']}",
        "Accept": "application/json, text/event-stream",
    }
    call = {
        "jsonrpc": "2.0",
        "id": 7,
        "method": "tools/call",
        "params": {
            "name": "execute_code",
            "arguments": {"code": "import time\nprint('started', flush=True)\ntime.sleep(60)"},
            "_meta": {"progressToken": "p7"},
        },
    }
    cancel = {
        "jsonrpc": "2.0",
        "method": "notifications/cancelled",
        "params": {"requestId": 7, "reason": "the test changed its mind"},
    }
    async with httpx2.AsyncClient(timeout=CALL_DEADLINE) as http, asyncio.timeout(CALL_DEADLINE):
        opened = await http.post(gw.url, headers=headers, json=initialize(version))
        session = {**headers, "mcp-session-id": opened.headers["mcp-session-id"]}
        session["mcp-protocol-version"] = version
        done = {"jsonrpc": "2.0", "method": "notifications/initialized"}
        assert (await http.post(gw.url, headers=session, json=done)).status_code == 202
        seen: list[dict[str, Any]] = []
        async with http.stream("POST", gw.url, headers=session, json=call) as stream:
            lines = stream.aiter_lines()
            async for line in lines:  # until the cell runs: its first notification
                if line.startswith("data:"):
                    seen.append(json.loads(line[5:]))
                    break
            said = await http.post(gw.url, headers=session, json=cancel)
            assert said.status_code == 202, said.text
            seen += [json.loads(line[5:]) async for line in lines if line.startswith("data:")]
    assert seen and "method" in seen[0], seen  # the cell ran
    assert not [m for m in seen if m.get("id") == 7], seen  # and nothing answered it


async def sse_events(response: httpx2.Response) -> AsyncIterator[tuple[str | None, Any]]:
    """An SSE body's events as they come: (id, the JSON-RPC message, None if no data)."""
    event_id, data = None, ""
    async for line in response.aiter_lines():
        if line.startswith("id:"):
            event_id = line[3:].strip()
        elif line.startswith("data:"):
            data += line[5:].strip()
        elif not line and (event_id is not None or data):
            yield event_id, json.loads(data) if data else None
            event_id, data = None, ""


async def opened(http: httpx2.AsyncClient, gw: HttpGateway, name: str) -> dict[str, str]:
    """A new MCP session of `name`'s (2025-11-25), initialized; its request headers."""
    sent = {
        "Accept": "application/json, text/event-stream",
        "Content-Type": "application/json",
        "Authorization": f"Bearer {gw.tokens[name]}",
    }
    r = await http.post(gw.url, headers=sent, json=initialize("2025-11-25"))
    assert r.status_code == 200, r.text
    sent = {
        **sent,
        "mcp-session-id": r.headers["mcp-session-id"],
        "mcp-protocol-version": "2025-11-25",
    }
    note = {"jsonrpc": "2.0", "method": "notifications/initialized"}
    assert (await http.post(gw.url, headers=sent, json=note)).status_code == 202
    return sent


async def test_a_dropped_stream_resumes_with_what_was_missed_and_nothing_else(
    gw: HttpGateway,
) -> None:
    code = (
        "import time\nfor i in range(3):\n    print('tick', i, flush=True)\n    time.sleep(1)\n42"
    )
    call = {
        "jsonrpc": "2.0",
        "id": 7,
        "method": "tools/call",
        "params": {
            "name": "execute_code",
            "arguments": {"code": code},
            "_meta": {"progressToken": 1},
        },
    }
    async with httpx2.AsyncClient(timeout=httpx2.Timeout(30.0, read=CALL_DEADLINE)) as http:
        alice = await opened(http, gw, "alice")
        seen: list[tuple[str | None, Any]] = []
        async with http.stream("POST", gw.url, headers=alice, json=call) as r:
            async for event in sse_events(r):
                seen.append(event)
                if "tick 0" in json.dumps(event[1]):
                    break  # the connection drops here, the cell runs on
        last = seen[-1][0]
        assert last is not None and seen[0][1] is None, seen  # a priming event came first
        # Another client's session, and another session of the same client, resuming from
        # that event: nothing of it.
        for other in (await opened(http, gw, "bob"), await opened(http, gw, "alice")):
            async with http.stream("GET", gw.url, headers={**other, "Last-Event-ID": last}) as r:
                assert [e async for e in sse_events(r) if e[1] is not None] == [], other
        replayed: list[tuple[str | None, Any]] = []
        async with http.stream("GET", gw.url, headers={**alice, "Last-Event-ID": last}) as r:
            assert r.status_code == 200
            async for event in sse_events(r):
                replayed.append(event)
                if isinstance(event[1], dict) and event[1].get("id") == 7:
                    break
    sent = [m for _, m in replayed if m is not None]
    output = [m["params"]["data"] for m in sent if m.get("method") == "notifications/message"]
    assert "".join(output) == "tick 1\ntick 2\n", sent  # what it missed, and only that
    assert any(m.get("method") == "notifications/progress" for m in sent), sent
    assert sent[-1]["result"]["structuredContent"]["result"]["data"]["text/plain"] == "42"
    ids = [i for i, _ in replayed if i is not None]
    assert not set(ids) & {i for i, _ in seen}, "nothing already received comes again"
    assert len(ids) == len(set(ids))


@pytest.mark.filterwarnings("ignore:resources/")  # the client's: deprecated at 2026-07-28
async def test_a_subscribed_file_or_notebook_is_notified_when_it_changes_and_only_then(
    gw: HttpGateway,
) -> None:
    updated: list[str] = []
    arrived = asyncio.Event()

    async def on_message(message: Any) -> None:
        if getattr(message, "method", None) == "notifications/resources/updated":
            updated.append(str(message.params.uri))
            arrived.set()

    async def next_update() -> str:
        async with asyncio.timeout(CALL_DEADLINE):
            await arrived.wait()
        arrived.clear()
        return updated[-1]

    async with client(gw, "alice", mode="legacy", message_handler=on_message) as c:
        resources = c.server_capabilities.resources
        assert resources is not None and resources.subscribe, c.server_capabilities
        ran = await c.call_tool(
            "execute_code", {"code": "open('/workspace/a.txt', 'w').write('a')"}
        )
        sid = ran.structured_content["session_id"]
        files = f"forge://sessions/{sid}/files/"
        for name in ("a.txt", "b.txt", "c.txt"):  # b and c do not exist yet
            await c.subscribe_resource(files + name)
        # b is written, a is not: b is notified, and a, which would come first, is not.
        await c.call_tool("write_file", {"session_id": sid, "path": "b.txt", "content": "b"})
        assert await next_update() == files + "b.txt"
        assert updated == [files + "b.txt"]
        # Unsubscribed from b: when b and c change, c alone is notified.
        await c.unsubscribe_resource(files + "b.txt")
        code = "for n in 'bc': open(f'/workspace/{n}.txt', 'w').write(n * 2)"
        await c.call_tool("execute_code", {"code": code, "session_id": sid})
        assert await next_update() == files + "c.txt"
        assert updated == [files + "b.txt", files + "c.txt"]
        # The notebook changes with every cell run.
        await c.subscribe_resource(f"forge://sessions/{sid}/notebook")
        await c.call_tool("execute_code", {"code": "1", "session_id": sid})
        assert await next_update() == f"forge://sessions/{sid}/notebook"
        for bad in (f"{files}../../etc/passwd", "test://watched-resource"):
            with pytest.raises(MCPError) as refused:  # the resources of resources/read only
                await c.subscribe_resource(bad)
            assert refused.value.error.code == -32602, bad
    async with client(gw, "bob", mode="legacy") as c:  # not bob's session: as if not there
        with pytest.raises(MCPError) as refused:
            await c.subscribe_resource(files + "a.txt")
        assert refused.value.error.code == -32602


async def test_on_2026_07_28_a_listen_stream_gets_its_clients_resource_updates_only(
    gw: HttpGateway,
) -> None:
    """subscriptions/listen: the URIs that pass resources/read's checks are honored (the
    acknowledgement says which), a change made by a call is delivered on the stream, and
    another client's session, or a path out of /workspace, is left out."""
    async with client(gw, "alice") as c, client(gw, "bob") as other:
        declared = c.server_capabilities.resources
        assert declared is not None and declared.subscribe and not declared.list_changed
        ran = await c.call_tool("execute_code", {"code": "1"})
        sid = ran.structured_content["session_id"]
        files = f"forge://sessions/{sid}/files/"
        asked = [files + "l.txt", f"forge://sessions/{sid}/notebook", files + "../../etc/passwd"]
        async with c.listen(resource_subscriptions=asked) as sub:
            assert sub.honored.resource_subscriptions == asked[:2], sub.honored
            await c.call_tool("write_file", {"session_id": sid, "path": "l.txt", "content": "x"})
            async with asyncio.timeout(CALL_DEADLINE):
                event = await anext(aiter(sub))
            assert isinstance(event, ResourceUpdated) and event.uri == files + "l.txt", event
            await c.call_tool("execute_code", {"code": "2", "session_id": sid})
            async with asyncio.timeout(CALL_DEADLINE):
                event = await anext(aiter(sub))
            assert isinstance(event, ResourceUpdated) and event.uri == asked[1], event
        async with other.listen(resource_subscriptions=asked[:2]) as foreign:
            assert not foreign.honored.resource_subscriptions, foreign.honored  # not bob's
