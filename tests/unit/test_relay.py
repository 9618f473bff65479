"""The relay between the gateway's sockets and a kernel's (relay.py), on real sockets: a
Unix listener of the test stands for the kernel, and the test's own connections for the
gateway's libzmq."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from mcp_forge.jupyter.relay import Relay

DEADLINE = 10.0


class Kernel:
    """A listener standing for the kernel: it records what it is sent, and its
    connections can be written to."""

    def __init__(self) -> None:
        self.received: asyncio.Queue[bytes] = asyncio.Queue()
        self.writers: list[asyncio.StreamWriter] = []
        self.connected = asyncio.Event()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.append(writer)
        self.connected.set()
        while data := await reader.read(65536):
            await self.received.put(data)


@asynccontextmanager
async def relay_to(
    tmp_path: Path, *, bound: int, readable: bool
) -> AsyncIterator[tuple[Relay, Kernel]]:
    kernel = Kernel()
    path = str(tmp_path / "kernel-shell")
    server = await asyncio.start_unix_server(kernel.handle, path)
    relay = Relay("shell", f"ipc://{path}", bound=bound, readable=lambda: readable)
    try:
        yield relay, kernel
    finally:
        relay.close()
        server.close()


async def open_relay(relay: Relay) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    address = "\0" + relay.url.removeprefix("ipc://@")
    return await asyncio.open_unix_connection(address)


async def test_bytes_pass_both_ways_unchanged(tmp_path: Path) -> None:
    async with relay_to(tmp_path, bound=1 << 20, readable=False) as (relay, kernel):
        reader, writer = await open_relay(relay)
        writer.write(b"to the kernel")
        async with asyncio.timeout(DEADLINE):
            assert await kernel.received.get() == b"to the kernel"
            kernel.writers[0].write(b"to the gateway")
            assert await reader.readexactly(14) == b"to the gateway"
        writer.close()


async def test_a_connection_from_another_process_is_closed_unjoined(tmp_path: Path) -> None:
    async with relay_to(tmp_path, bound=1 << 20, readable=False) as (relay, kernel):
        address = "\0" + relay.url.removeprefix("ipc://@")
        probe = (
            "import socket, sys\n"
            "s = socket.socket(socket.AF_UNIX)\n"
            f"s.connect({address!r})\n"
            "s.settimeout(10)\n"
            "try:\n"
            "    s.sendall(b'stranger')\n"
            "    print(repr(s.recv(10)))\n"
            "except (BrokenPipeError, ConnectionResetError):\n"
            "    print(repr(b''))\n"
        )
        done = await asyncio.create_subprocess_exec(
            sys.executable, "-c", probe, stdout=subprocess.PIPE
        )
        async with asyncio.timeout(DEADLINE):
            out, _ = await done.communicate()
        assert out.strip() == b"b''"  # closed by the relay, nothing from the kernel
        assert not kernel.connected.is_set()


async def test_unread_bytes_past_the_bound_with_no_whole_message_close_the_pair(
    tmp_path: Path,
) -> None:
    """The kernel writes without end and the gateway side reads nothing whole: the relay
    passes about `bound` bytes, then closes both connections."""
    bound = 1 << 20
    async with relay_to(tmp_path, bound=bound, readable=False) as (relay, kernel):
        reader, writer = await open_relay(relay)
        async with asyncio.timeout(DEADLINE):
            await kernel.connected.wait()
            flood = kernel.writers[0]
            chunk = b"x" * 65536

            async def write_forever() -> None:
                while True:
                    flood.write(chunk)
                    await flood.drain()

            writing = asyncio.create_task(write_forever())
            got = 0
            while data := await reader.read(1 << 20):
                got += len(data)
            writing.cancel()
            await asyncio.gather(writing, return_exceptions=True)
        assert bound <= got < bound + (1 << 20), got
        writer.close()


async def test_a_gateway_behind_on_whole_messages_is_waited_for_not_cut(
    tmp_path: Path,
) -> None:
    """Past the bound with whole messages to read, the relay pauses; credit resumes it."""
    bound = 1 << 20
    async with relay_to(tmp_path, bound=bound, readable=True) as (relay, kernel):
        reader, writer = await open_relay(relay)
        async with asyncio.timeout(DEADLINE):
            await kernel.connected.wait()
            total = 4 * bound
            kernel.writers[0].write(b"y" * total)
            got = 0
            while got < total:
                data = await reader.read(1 << 20)
                assert data, "the relay closed a connection it should have paused"
                got += len(data)
                relay.consumed(len(data))
        assert got == total
        writer.close()


async def test_a_kernel_that_listens_late_is_reached_and_nothing_sent_meanwhile_is_lost(
    tmp_path: Path,
) -> None:
    """A kernel starting (or restarting): the gateway's connection is held, what it sent
    meanwhile waits (more than the relay keeps in memory: the rest waits in the socket),
    and all of it reaches the kernel once it listens."""
    kernel = Kernel()
    path = str(tmp_path / "kernel-iopub")
    relay = Relay("iopub", f"ipc://{path}", bound=1 << 20, readable=lambda: False)
    sent = bytes(range(256)) * (3 << 12)  # 3 MiB, over EARLY_MAX
    try:
        reader, writer = await open_relay(relay)
        writer.write(sent)
        server = await asyncio.start_unix_server(kernel.handle, path)
        async with asyncio.timeout(DEADLINE):
            got = bytearray()
            while len(got) < len(sent):
                got += await kernel.received.get()
            assert bytes(got) == sent
            kernel.writers[0].write(b"hello")
            assert await reader.readexactly(5) == b"hello"
        writer.close()
        server.close()
    finally:
        relay.close()
