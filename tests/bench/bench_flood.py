"""Benchmark: output floods through the gateway next to a bare local ipykernel, in one run.

    sudo .venv/bin/python tests/bench/bench_flood.py [--runs 3]

For each flood of issue 10 (a 200 MB print, a 150 MB display, a 50 MB exception, 100,000
small displays, and a 100 MB print by code that removed the kernel's output guard), the
median (and max) wall time of:
  * execute_code over MCP stdio to `mcp-forge gateway` (kernel in a Podman pod), where the
    kernel's guard and the gateway bound the output;
  * the same code on a bare local ipykernel driven by jupyter-client, every output message
    read until idle (the baseline: what the flood costs with no bound at all);
their ratio, and how much the gateway's peak resident memory grew (each flood gets a
fresh gateway, so each growth is its own). A flood must cost seconds, not minutes.
The machines are shared and noisy: compare ratios, not absolute numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))
from bench_local import bare_execute, bare_start, stats

from adversarial.conftest import gateway, gateway_peak_rss, run
from adversarial.test_output import CALL, GUARD_REMOVED, MB
from support import scratch_state_dir

DISPLAY = "from IPython.display import display\n"
FLOODS = [
    ("200 MB print", "print('HEAD' + 'x' * 200_000_000)"),
    (
        "150 MB display",
        DISPLAY + "display({'image/png': 'A' * 150_000_000, 'text/plain': 'big'}, raw=True)",
    ),
    ("50 MB exception", "raise ValueError('BEGIN' + 'v' * 50_000_000)"),
    (
        "100,000 displays",
        DISPLAY + "for i in range(100_000):\n    display({'text/plain': f'd{i}'}, raw=True)",
    ),
    ("100 MB print, guard removed", GUARD_REMOVED + "print('X' * 100_000_000)"),
]


async def through_gateway(code: str, runs: int) -> tuple[list[float], int, list[str]]:
    """Wall times of `runs` execute_code calls of `code` on a fresh gateway's session, the
    growth of the gateway's peak memory over them, and each call's status."""
    with scratch_state_dir("mf-bench-") as state:
        async with gateway(state) as client:
            made = await client.call_tool("create_session", {"variant": "minimal"})
            assert made.structured_content is not None, made
            sid = made.structured_content["session_id"]
            await run(client, "1", session_id=sid)
            before = gateway_peak_rss(state)
            times, statuses = [], []
            for _ in range(runs):
                t = time.perf_counter()
                r = await run(client, code, session_id=sid, timeout=CALL)
                times.append(time.perf_counter() - t)
                statuses.append(r["status"])
            return times, gateway_peak_rss(state) - before, statuses


async def bare(code: str, runs: int) -> list[float]:
    """Wall times of `runs` executions of `code` on a bare local ipykernel of its own (the
    guard-removed case, or a bare kernel's memory after 200 MB, cannot skew the next)."""
    _, km = await bare_start()
    try:
        return await bare_execute(km, runs, code)
    finally:
        await km.shutdown_kernel(now=True)


async def main(runs: int) -> None:
    rows = []
    for label, code in FLOODS:
        forge, grew, statuses = await through_gateway(code, runs)
        rows.append((label, forge, await bare(code, runs), grew, statuses))

    title = f"flood, wall time s (n={runs})"
    print(f"{title:30}{'MCP-Forge (pod)':>18}{'bare ipykernel':>18}{'ratio':>8}"
          f"{'gateway peak':>14}  statuses")  # fmt: skip
    for label, forge, base, grew, statuses in rows:
        fm, bm = stats(forge)[0], stats(base)[0]
        print(
            f"{label:30}{fm:>10.2f} max {max(forge):<5.2f}{bm:>10.2f} max {max(base):<5.2f}"
            f"{fm / bm:>7.2f}x{grew / MB:>+11.0f} MB  {'/'.join(sorted(set(statuses)))}"
        )


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=3)
    a = p.parse_args()
    asyncio.run(main(a.runs))
