"""What a tool's answer looks like to an MCP client: an execution result as one text a
model reads in one go plus images, a file as image, text or base64 content, a session
as its SessionInfo; pure functions, no I/O."""

from __future__ import annotations

import base64
from typing import Literal

from mcp_types import CallToolResult, ContentBlock, ImageContent, TextContent

from mcp_forge.api import status as st
from mcp_forge.api.kernelsession import KernelSession
from mcp_forge.api.kernelsessionpool import WARM_START
from mcp_forge.gateway.mcp.models import ExecuteOutput, FileRead, SessionInfo
from mcp_forge.jupyter.execution import ExecutionResult

IMAGE_MIMES = ("image/png", "image/jpeg", "image/gif", "image/webp")


def session_info(
    session: KernelSession, *, execution_count: int | None, owned: bool
) -> SessionInfo:
    """What a client is told about a session."""
    status = session.status
    warm = next((c for c in status.get("conditions") or [] if c.get("type") == WARM_START), {})
    return SessionInfo(
        session_id=session.name,
        phase=str(status.get("phase", st.PENDING)),
        image=session.spec.image,
        memory=session.spec.memory,
        cpu=session.spec.cpu,
        idle_timeout=session.body["spec"]["idleTimeout"],
        created=session.body["metadata"].get("creationTimestamp"),
        last_activity=status.get("lastActivity"),
        restarts=int(status.get("restarts", 0)),
        execution_count=execution_count,
        owned=owned,
        start="warm" if warm.get("status") == "True" else "cold",
        start_reason=warm.get("message") if warm.get("status") == "False" else None,
    )


def sniff_image(data: bytes) -> str | None:
    """The image type a file's first bytes say, if it is one a client can show."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "image/png"
    if data.startswith(b"\xff\xd8\xff"):
        return "image/jpeg"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "image/gif"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    return None


def execution_content(result: ExecutionResult) -> list[ContentBlock]:
    """The result as text a model reads in one go, plus images as image content."""
    parts: list[str] = []
    if result.stdout:
        parts.append(f"[stdout]\n{result.stdout.rstrip()}")
    if result.stderr:
        parts.append(f"[stderr]\n{result.stderr.rstrip()}")
    if result.result is not None and "text/plain" in result.result["data"]:
        parts.append(f"[result]\n{result.result['data']['text/plain']}")
    for display in result.displays:
        text = display["data"].get("text/markdown") or display["data"].get("text/plain")
        if text and not any(m in display["data"] for m in IMAGE_MIMES):
            parts.append(f"[display]\n{text}")
    if result.error is not None:
        parts.append(
            "[error]\n"
            + "\n".join(result.error.traceback or (f"{result.error.ename}: {result.error.evalue}",))
        )
    if result.status not in ("ok", "error") or result.message:
        parts.append(f"[{result.status}] {result.message}".rstrip())
    if not parts:
        parts.append("[ok] (no output)")
    content: list[ContentBlock] = [TextContent(type="text", text="\n\n".join(parts))]
    for bundle in (*result.displays, *([result.result] if result.result else [])):
        for mime in IMAGE_MIMES:
            data = bundle["data"].get(mime)
            if isinstance(data, str):
                content.append(ImageContent(type="image", data=data.strip(), mime_type=mime))
                break
    return content


def execution_result(session_id: str, result: ExecutionResult) -> CallToolResult:
    """execute_code's answer: the content above, the whole result as structuredContent,
    and isError unless the code ran to its end without raising."""
    structured = ExecuteOutput(session_id=session_id, **result.to_dict())
    return CallToolResult(
        content=execution_content(result),
        structured_content=structured.model_dump(mode="json"),
        is_error=result.status != "ok",
    )


def file_result(session_id: str, path: str, data: bytes) -> CallToolResult:
    """read_file's answer: an image as image content, UTF-8 text as text, anything else
    as base64 text; structuredContent says which."""
    mime = sniff_image(data)
    content: list[ContentBlock]
    if mime is not None:
        encoding: Literal["text", "base64"] = "base64"
        content = [ImageContent(type="image", data=base64.b64encode(data).decode(), mime_type=mime)]
    else:
        try:
            text = data.decode("utf-8")
            encoding = "text"
        except UnicodeDecodeError:
            text = base64.b64encode(data).decode()
            encoding = "base64"
        content = [TextContent(type="text", text=text)]
    info = FileRead(
        session_id=session_id, path=path, size=len(data), encoding=encoding, mime_type=mime
    )
    return CallToolResult(content=content, structured_content=info.model_dump(mode="json"))
