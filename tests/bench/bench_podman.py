"""Benchmark: Podman through its CLI next to Podman through its API, in one run.

    sudo .venv/bin/python tests/bench/bench_podman.py [--runs 10]

Each operation local mode makes, done both ways on the same pods, alternately:
  * create: `podman kube play --network=none -` of a pod from the kernel image, next to
    POST /play/kube (network=none) of the same YAML;
  * inspect, list by label (`podman ps`), image exists, logs: what a session create or a
    supervisor pass asks;
  * delete: `podman pod rm -f -t 0` next to the API's kill + DELETE /pods;
  * death detection: the pod's process is SIGKILLed; time until `podman ps` polled back
    to back no longer lists it (the best case of the supervisor's poll, which runs every
    10 s by default: on average it notices ~5 s after), until `podman events` (a CLI
    process) prints `died`, and until the API's event stream says `died`.
Prints medians, p90 and the CLI/API ratio. The machine is shared and noisy: compare the
ratios. The pods are ours alone (label mcpforge.dev/bench=<run id>), removed at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import time
import uuid
from collections import defaultdict
from collections.abc import Awaitable

import yaml

from mcp_forge.clients import podman, podman_api
from mcp_forge.clients.podman_api import PodmanApi

IMAGE = "localhost/mcp-forge-kernel:0.1.0-minimal"
RUN = uuid.uuid4().hex[:8]
LABEL = f"mcpforge.dev/bench={RUN}"


def stats(xs: list[float]) -> tuple[float, float]:
    xs = sorted(xs)
    return statistics.median(xs), xs[min(len(xs) - 1, int(len(xs) * 0.9))]


def pod_yaml(name: str) -> str:
    """A pod like a kernel's: the kernel image, no network, a process that waits."""
    return yaml.safe_dump(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "labels": {"mcpforge.dev/bench": RUN}},
            "spec": {
                "restartPolicy": "Never",
                "terminationGracePeriodSeconds": 5,
                "containers": [
                    {
                        "name": "kernel",
                        "image": IMAGE,
                        "command": ["sleep", "infinity"],
                        "securityContext": {"runAsUser": 1000, "readOnlyRootFilesystem": True},
                    }
                ],
            },
        }
    )


async def timed(call: Awaitable[object]) -> float:
    """Seconds `call` (a coroutine not yet started) takes."""
    t = time.perf_counter()
    await call
    return time.perf_counter() - t


class Streams:
    """`podman events` (CLI) and the API's event stream, read side by side: when each
    first reported each (container, status)."""

    def __init__(self, api: PodmanApi) -> None:
        self.api = api
        self.seen: dict[str, dict[tuple[str, str], float]] = defaultdict(dict)
        self.news = asyncio.Condition()
        self.tasks: list[asyncio.Task[None]] = []
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        self.tasks = [asyncio.ensure_future(self._api()), asyncio.ensure_future(self._cli())]

    async def _note(self, way: str, name: str, status: str) -> None:
        async with self.news:
            self.seen[way].setdefault((name, status), time.perf_counter())
            self.news.notify_all()

    async def _api(self) -> None:
        async for event in self.api.events(label=LABEL, statuses=("start", "died")):
            await self._note("api", event.name, event.status)

    async def _cli(self) -> None:
        binary = podman.podman_binary()
        assert binary is not None
        self.proc = await asyncio.create_subprocess_exec(
            binary, "events", "--format", "json", "--filter", f"label={LABEL}",
            stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        assert self.proc.stdout is not None
        async for line in self.proc.stdout:
            event = json.loads(line)
            if event.get("Type") == "container":
                await self._note("cli", event.get("Name", ""), event.get("Status", ""))

    async def wait(self, name: str, status: str, deadline: float = 30) -> dict[str, float]:
        """When each way saw it (perf_counter), once both have."""
        async with asyncio.timeout(deadline), self.news:
            await self.news.wait_for(
                lambda: all((name, status) in self.seen[w] for w in ("api", "cli"))
            )
        return {w: self.seen[w][(name, status)] for w in ("api", "cli")}

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def poll_until_gone(name: str) -> float:
    """`podman ps` back to back until the container is no longer listed: when that was."""
    while True:
        rows = await podman.run_json("ps", "--filter", f"label={LABEL}", "--format", "json")
        if not any(name in (row.get("Names") or []) for row in rows or []):
            return time.perf_counter()


async def main(runs: int) -> None:
    api = await podman_api.connect()
    streams = Streams(api)
    await streams.start()
    results: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    made: list[str] = []

    def note(op: str, way: str, seconds: float) -> None:
        results[op][way].append(seconds)

    try:
        for i in range(runs):
            for way in ("cli", "api") if i % 2 == 0 else ("api", "cli"):
                pod = f"mfbench-{RUN}-{way}-{i}"
                made.append(pod)
                text = pod_yaml(pod)
                creating = (
                    podman.run("kube", "play", "--network=none", "-", input=text.encode())
                    if way == "cli"
                    else api.play_kube(text, network="none")
                )
                note("create (kube play)", way, await timed(creating))
                container = f"{pod}-kernel"
                await streams.wait(container, "start")  # both streams are live
                calls: dict[str, Awaitable[object]] = (
                    {
                        "inspect": podman.run("container", "inspect", container),
                        "ps by label": podman.run(
                            "ps", "--filter", f"label={LABEL}", "--format", "json"
                        ),
                        "image exists": podman.run("image", "exists", IMAGE),
                        "logs --tail 20": podman.run("logs", "--tail", "20", container),
                    }
                    if way == "cli"
                    else {
                        "inspect": api.inspect_container(container),
                        "ps by label": api.containers(LABEL),
                        "image exists": api.image_exists(IMAGE),
                        "logs --tail 20": api.logs(container, tail=20),
                    }
                )
                for op, call in calls.items():
                    note(op, way, await timed(call))
                if way == "cli":
                    info = await api.inspect_container(container)
                    assert info is not None
                    polled = asyncio.ensure_future(poll_until_gone(container))
                    killed = time.perf_counter()
                    os.kill(int(info["State"]["Pid"]), signal.SIGKILL)
                    seen = await streams.wait(container, "died")
                    note("death: podman ps polled back to back", "cli", await polled - killed)
                    note("death: event stream", "cli", seen["cli"] - killed)
                    note("death: event stream", "api", seen["api"] - killed)

            # delete, both ways, on this round's two pods (one of them died above)
            for way in ("cli", "api") if i % 2 == 0 else ("api", "cli"):
                pod = f"mfbench-{RUN}-{way}-{i}"
                deleting = (
                    podman.run("pod", "rm", "-f", "-t", "0", pod)
                    if way == "cli"
                    else api.remove_pod(pod)
                )
                note("delete (pod rm -f -t 0)", way, await timed(deleting))
                made.remove(pod)
            print(f"round {i + 1}/{runs} done", flush=True)
    finally:
        await streams.stop()
        for pod in made:
            await podman.run("pod", "rm", "-f", "-t", "0", pod, check=False)

    print(f"\n{runs} runs each, medians (p90) in ms; CLI/API is the ratio of the medians")
    print(f"{'operation':40} {'CLI':>16} {'API':>16} {'CLI/API':>8}")
    for op, ways in results.items():
        cells = []
        for way in ("cli", "api"):
            if ways.get(way):
                med, p90 = stats(ways[way])
                cells.append(f"{med * 1000:7.1f} ({p90 * 1000:6.1f})")
            else:
                cells.append("-")
        ratio = (
            f"{statistics.median(ways['cli']) / statistics.median(ways['api']):7.1f}x"
            if ways.get("cli") and ways.get("api")
            else ""
        )
        print(f"{op:40} {cells[0]:>16} {cells[1]:>16} {ratio:>8}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main(args.runs))
