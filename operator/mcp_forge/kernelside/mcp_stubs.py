"""The tools of code mode's bridge as Python: mcp_tools' names, signatures and docstrings.

An upstream tool becomes a `Tool` (its Python names, its signature and docstring, made
from its inputSchema and description), then a pair of functions (`functions`: the call
and its asyncio twin) on a `Namespace` per server; `outcome` makes a result frame the
value or the exception the caller gets. mcp_tools.py (the bridge) builds these from a
hello and calls through them; the rules they follow are those mcp_tools' docstring
states to users.

The gateway sends this module's source with mcp_tools'; in the kernel, which has no
mcp_forge package, kernelside/bridge_boot.py runs it as a module of its own and hands it
to the modules after it. Standard library only.
"""

import functools
import inspect
import keyword
import operator
import types
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

MAX_PARAMS = 512
MAX_NAME = 256
MAX_DESCRIPTION = 16384
MAX_PARAM_DESCRIPTION = 2048
MAX_MESSAGE = 65536
EMPTY = inspect.Parameter.empty
JSON_TYPES: dict[str, Any] = {
    "string": str,
    "integer": int,
    "number": float,
    "boolean": bool,
    "array": list,
    "object": dict,
    "null": None,
}
HINTS = (
    ("readOnlyHint", "read-only"),
    ("destructiveHint", "destructive"),
    ("idempotentHint", "idempotent"),
    ("openWorldHint", "open-world"),
)


class ToolError(Exception):
    """A call to an MCP tool failed; the message says why.

    .kind is "tool" when the tool itself reported the error, "unavailable" when it could
    not run or answer (server down, timeout, budget, rate limit, result too large, no
    bridge connection). .server and .tool name it as its server spells them.
    """

    def __init__(
        self,
        message: str,
        *,
        server: str | None = None,
        tool: str | None = None,
        kind: str = "tool",
    ) -> None:
        super().__init__(message)
        self.server = server
        self.tool = tool
        self.kind = kind


class ProtocolError(Exception):
    """The gateway sent something the bridge refuses: the connection closes."""


def clip(text: object, limit: int) -> str:
    """text cut to limit characters; anything but a string is empty."""
    if not isinstance(text, str):
        return ""
    return text if len(text) <= limit else text[:limit] + "...[truncated]"


# -- names and signatures ------------------------------------------------------------


def identifier(name: str) -> str:
    """name as a Python identifier, before collisions (the rule: the module docstring)."""
    ident = "".join(c if c.isascii() and (c.isalnum() or c == "_") else "_" for c in name)
    ident = ident or "_"
    if ident[0].isdigit():
        ident = "_" + ident
    if keyword.iskeyword(ident) or (ident.startswith("__") and ident.endswith("__")):
        ident += "_"
    return ident


def identifiers(names: list[str], reserved: tuple[str, ...] = ()) -> dict[str, str]:
    """{name: identifier} for distinct names, none of them in reserved nor shared."""
    taken = set(reserved)
    idents = {}
    for name in sorted(names, key=lambda n: (identifier(n) != n, n)):
        ident = identifier(name)
        while ident in taken:
            ident += "_"
        taken.add(ident)
        idents[name] = ident
    return idents


# An annotation made from a schema is a type, a union of types, None, or EMPTY (none).


def annotation(schema: object, depth: int = 0) -> Any:
    """The Python annotation for a JSON schema's type, or EMPTY when there is none."""
    if not isinstance(schema, dict) or depth > 3:
        return EMPTY
    kind = schema.get("type")
    if isinstance(kind, str):
        if kind == "array":
            item = annotation(schema.get("items"), depth + 1)
            return list if item is EMPTY else list[item]  # type: ignore[valid-type]
        return JSON_TYPES.get(kind, EMPTY)
    if isinstance(kind, list):
        return union([JSON_TYPES.get(k, EMPTY) if isinstance(k, str) else EMPTY for k in kind[:8]])
    for key in ("anyOf", "oneOf"):
        options = schema.get(key)
        if isinstance(options, list) and options:
            return union([annotation(option, depth + 1) for option in options[:8]])
    return EMPTY


def union(options: list[Any]) -> Any:
    """X | Y | None for known options; EMPTY if any is unknown."""
    if not options or any(option is EMPTY for option in options):
        return EMPTY
    distinct: list[Any] = []
    for option in options:
        if option not in distinct:
            distinct.append(option)
    real = [option for option in distinct if option is not None]
    if not real:
        return None
    result = functools.reduce(operator.or_, real)
    return result | None if None in distinct else result


def optional(ann: Any) -> Any:
    """ann for a parameter whose default is None."""
    if ann is EMPTY or ann is None:
        return ann
    if isinstance(ann, types.UnionType) and type(None) in ann.__args__:
        return ann
    return ann | None


class Tool:
    """One upstream tool: its names, its signature and docstring, its JSON argument names."""

    def __init__(self, server: str, server_ident: str, spec: dict[str, Any], ident: str) -> None:
        self.server = server
        self.name: str = spec["name"]
        self.ident = ident
        self.qualname = server_ident + "." + ident
        schema = spec.get("inputSchema")
        schema = schema if isinstance(schema, dict) else {}
        props = schema.get("properties")
        props = props if isinstance(props, dict) else {}
        listed = schema.get("required")
        listed = listed if isinstance(listed, list) else []
        required = [r for r in listed if isinstance(r, str)]
        names = list(props) + [r for r in dict.fromkeys(required) if r not in props]
        names = [n for n in names if len(n) <= MAX_NAME][:MAX_PARAMS]
        py = identifiers(names)
        self.json_names = {py[n]: n for n in names}
        params = []
        for name in sorted(names, key=lambda n: n not in required):  # required first
            prop = props.get(name)
            prop = prop if isinstance(prop, dict) else {}
            ann = annotation(prop)
            default: Any
            if name in required:
                default = EMPTY
            else:
                default = prop.get("default")
                if default is None:
                    ann = optional(ann)
            kind = inspect.Parameter.KEYWORD_ONLY
            params.append(inspect.Parameter(py[name], kind, default=default, annotation=ann))
        # Declared open (additionalProperties true or a schema): **kwargs pass through as they are.
        self.extra: str | None = None
        more = schema.get("additionalProperties")
        if more is True or isinstance(more, dict):
            extra = "kwargs"
            while extra in self.json_names:
                extra += "_"
            self.extra = extra
            params.append(inspect.Parameter(extra, inspect.Parameter.VAR_KEYWORD))
        self.signature = inspect.Signature(params)
        self.doc = self.docstring(spec, props)

    def docstring(self, spec: dict[str, Any], props: dict[str, Any]) -> str:
        lines = [
            clip(spec.get("description"), MAX_DESCRIPTION).strip()
            or f"The tool {self.name!r} of the MCP server {self.server!r}."
        ]
        if self.signature.parameters:
            lines += ["", "Parameters:"]
        for param in self.signature.parameters.values():
            if param.kind is inspect.Parameter.VAR_KEYWORD:
                lines.append(f"    **{param.name}: further arguments, sent as they are")
                continue
            json_name = self.json_names[param.name]
            prop = props.get(json_name)
            prop = prop if isinstance(prop, dict) else {}
            ann = annotation(prop)  # as the schema says: "optional" stands for the None
            facts = [] if ann is EMPTY else [inspect.formatannotation(ann)]
            if param.default is EMPTY:
                facts.append("required")
            elif "default" in prop:
                facts.append("default " + clip(repr(param.default), 200))
            else:
                facts.append("optional")
            if json_name != param.name:
                facts.append(f"sent as {json_name!r}")
            text = clip(prop.get("description"), MAX_PARAM_DESCRIPTION).strip()
            enum = prop.get("enum")
            if isinstance(enum, list) and enum:
                values = ", ".join(clip(repr(v), 100) for v in enum[:20])
                values += ", ..." if len(enum) > 20 else ""
                text = (text + " " if text else "") + "One of: " + values + "."
            line = f"    {param.name} ({', '.join(facts)})"
            lines.append(line + ": " + text.replace("\n", "\n        ") if text else line)
        notes = spec.get("annotations")
        hints = [
            label for key, label in HINTS if isinstance(notes, dict) and notes.get(key) is True
        ]
        lines += [""] + (["Hints: " + ", ".join(hints) + "."] if hints else [])
        lines.append(f"MCP tool {self.name!r} of server {self.server!r}.")
        return "\n".join(lines)

    def arguments(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """The call's JSON arguments, or TypeError as a Python function would raise it."""
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"mcp_tools.{self.qualname}(): {exc}") from None
        out = {}
        for name, value in bound.arguments.items():
            if name == self.extra:
                out.update(value)
            elif value is not None or self.signature.parameters[name].default is not None:
                out[self.json_names[name]] = value
        return out


class Caller(Protocol):
    """What a tool's functions call through: the bridge (mcp_tools.Bridge)."""

    def call(self, tool: Tool, arguments: dict[str, Any]) -> Any: ...

    async def acall(self, tool: Tool, arguments: dict[str, Any]) -> Any: ...


def functions(
    bridge: Caller, tool: Tool
) -> tuple[Callable[..., Any], Callable[..., Coroutine[Any, Any, Any]]]:
    """The function that calls tool, and its asyncio twin."""

    def call(*args: Any, **kwargs: Any) -> Any:
        return bridge.call(tool, tool.arguments(args, kwargs))

    async def call_aio(*args: Any, **kwargs: Any) -> Any:
        return await bridge.acall(tool, tool.arguments(args, kwargs))

    for function, qualname in ((call, tool.qualname), (call_aio, tool.qualname + ".aio")):
        function.__name__ = tool.ident
        function.__qualname__ = qualname
        function.__module__ = "mcp_tools"
        function.__doc__ = tool.doc
        # help() and inspect.signature read these; mypy knows no such attributes of a function.
        vars(function)["__signature__"] = tool.signature
    vars(call)["aio"] = call_aio
    return call, call_aio


class Namespace:
    """The tools of one MCP server as functions; under mcp_tools.aio, the servers."""

    def __init__(self, label: str, members: dict[str, Any], unavailable: str | None = None) -> None:
        self.__dict__["__mcp_label__"] = label
        self.__dict__["__mcp_unavailable__"] = unavailable
        self.__dict__.update(members)

    def __getattr__(self, name: str) -> Any:
        # Only for names it does not have: say why a server has no tools, if it is known.
        label, why = self.__dict__["__mcp_label__"], self.__dict__["__mcp_unavailable__"]
        raise AttributeError(f"{label} has no {name!r}" + (f": {why}" if why else ""))

    def __repr__(self) -> str:
        names = sorted(name for name in vars(self) if not name.startswith("__mcp_"))
        return f"<{self.__dict__['__mcp_label__']}: {', '.join(names)}>"


class Server:
    """One upstream server, as the hello lists it."""

    def __init__(
        self,
        bridge: Caller,
        name: str,
        ident: str,
        specs: dict[str, dict[str, Any]],
        unavailable: str | None = None,
    ) -> None:
        self.name = name
        self.ident = ident
        idents = identifiers(list(specs))
        self.tools = {idents[n]: Tool(name, ident, spec, idents[n]) for n, spec in specs.items()}
        made = {t_ident: functions(bridge, tool) for t_ident, tool in self.tools.items()}
        self.namespace = Namespace(
            "mcp_tools." + ident, {i: f[0] for i, f in made.items()}, unavailable
        )
        self.aio_namespace = Namespace(
            "mcp_tools.aio." + ident, {i: f[1] for i, f in made.items()}, unavailable
        )


def docstring(text: str, indent: int) -> str:
    """text as a docstring literal at indent, safe to paste into source."""
    text = text.replace("\\", "\\\\").replace('"""', '\\"\\"\\"')
    text = "".join(c if c in "\n\t" or " " <= c != "\x7f" else f"\\x{ord(c):02x}" for c in text)
    if text.endswith('"'):
        text = text[:-1] + '\\"'
    pad = " " * indent
    lines = text.split("\n")
    if len(lines) == 1:
        return f'{pad}"""{text}"""'
    rest = [pad + line if line.strip() else "" for line in lines[1:]]
    return "\n".join([f'{pad}"""{lines[0]}', *rest, f'{pad}"""'])


# -- results ---------------------------------------------------------------------------


def failure(kind: str, message: str, server: str, tool: str) -> Exception:
    """The exception for an error result of that kind."""
    exc: Exception
    if kind == "denied":
        exc = PermissionError(message)
    elif kind == "invalid":
        exc = ValueError(message)
    else:
        return ToolError(message, server=server, tool=tool, kind=kind)
    vars(exc).update(server=server, tool=tool, kind=kind)  # what a ToolError carries
    return exc


def outcome(frame: dict[str, Any], server: str, tool: str) -> tuple[Any, Exception | None]:
    """(value, None) or (None, exception) for a result frame."""
    ok = frame.get("ok")
    if ok is False:
        error = frame.get("error")
        error = error if isinstance(error, dict) else {}
        kind = clip(error.get("kind"), 40) or "tool"
        message = clip(error.get("message"), MAX_MESSAGE) or f"the call failed ({kind})"
        return None, failure(kind, message, server, tool)
    content = frame.get("content")
    content = [] if content is None else content
    if (
        ok is not True
        or not isinstance(content, list)
        or not all(isinstance(item, dict) for item in content)
    ):
        malformed = "the gateway sent a malformed result"
        return None, ToolError(malformed, server=server, tool=tool, kind="unavailable")
    texts = [
        item.get("text")
        for item in content
        if item.get("type") == "text" and isinstance(item.get("text"), str)
    ]
    if frame.get("isError") is True:
        message = clip("\n".join(texts), MAX_MESSAGE) or "the tool reported an error"
        return None, ToolError(message, server=server, tool=tool, kind="tool")
    structured = frame.get("structured")
    if structured is not None:
        return structured, None
    if content and len(texts) == len(content):
        return "\n".join(texts), None
    return (content or None), None
