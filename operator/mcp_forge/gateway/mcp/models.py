"""What the MCP tools take and return, as pydantic models: the SDK makes each tool's
output schema from them, and their fields are the structuredContent a client reads."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel


class SessionInfo(BaseModel):
    session_id: str
    phase: str
    image: str
    memory: str
    cpu: str
    idle_timeout: str
    created: str | None = None
    last_activity: str | None = None
    restarts: int = 0
    execution_count: int | None = None
    memory_bytes: int | None = None
    owned: bool = True
    # warm: it claimed a kernel a pool had ready (tens of ms); cold: a new pod was started.
    start: Literal["warm", "cold"] = "cold"
    start_reason: str | None = None  # why it started cold, when a pool was asked


class SessionList(BaseModel):
    sessions: list[SessionInfo]


class Closed(BaseModel):
    session_id: str
    closed: bool


class ForkedSession(BaseModel):
    session_id: str
    phase: str
    # restored: it answers with the parent's variables; else a new kernel (message: why)
    restored: bool
    message: str


class Forked(BaseModel):
    session_id: str  # the parent
    forks: list[ForkedSession]


class ExecuteOutput(BaseModel):
    session_id: str
    status: Literal["ok", "error", "timeout", "interrupted", "died"]
    stdout: str
    stderr: str
    result: dict[str, Any] | None
    displays: list[dict[str, Any]]
    error: dict[str, Any] | None
    execution_count: int | None
    duration: float
    truncated: bool
    full_output_path: str | None
    state_lost: bool
    message: str


class Interrupted(BaseModel):
    session_id: str
    interrupted: bool


class Restarted(BaseModel):
    session_id: str
    restarted: bool
    message: str


class Variable(BaseModel):
    name: str
    type: str
    shape: list[int] | None = None
    dtype: str | None = None
    length: int | None = None
    size: int | None = None
    repr: str | None = None


class KernelTools(BaseModel):
    session_id: str
    servers: list[str]
    stubs: str


class Variables(BaseModel):
    session_id: str
    variables: list[Variable]


class FileEntry(BaseModel):
    name: str
    type: str
    size: int | None = None
    mtime: float | None = None


class FileList(BaseModel):
    session_id: str
    path: str
    entries: list[FileEntry]
    truncated: bool


class FileRead(BaseModel):
    session_id: str
    path: str
    size: int
    encoding: Literal["text", "base64"]
    mime_type: str | None = None


class NotebookExported(BaseModel):
    session_id: str
    path: str  # in the session's /workspace
    cells: int  # code cells
    size: int  # bytes of the .ipynb
    skipped: int  # journal records left out as malformed
    outputs_omitted: int = 0  # cells kept without their outputs: the file limit was reached


class FileWritten(BaseModel):
    session_id: str
    path: str
    size: int


class InstalledPackage(BaseModel):
    name: str  # PEP 503-normalized
    version: str
    size: int  # bytes of its wheel


class PackagesInstalled(BaseModel):
    session_id: str
    installed: list[InstalledPackage]  # what was asked for and every dependency
    total_bytes: int
    path: str  # the directory on the kernel's sys.path they are in
