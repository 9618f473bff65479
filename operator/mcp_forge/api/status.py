"""A KernelSession's status as the rest of the code reads it: how a kernel ended. Pure."""

from __future__ import annotations

import signal
from dataclasses import dataclass


@dataclass(frozen=True)
class Termination:
    """Why a kernel stopped."""

    reason: str  # "OOMKilled", "Error", "Completed", "PodMissing"
    exit_code: int | None
    message: str


def termination_of(exit_code: int | None, *, oom: bool, memory_limit: str) -> Termination:
    """Name a kernel's death in words a person (or a model) can act on."""
    if oom:
        return Termination(
            "OOMKilled",
            exit_code,
            f"the kernel ran out of memory (limit {memory_limit}) and was killed (OOM)",
        )
    if exit_code == 0:
        return Termination("Completed", exit_code, "the kernel exited")
    if isinstance(exit_code, int) and exit_code > 128:
        try:
            sig = signal.Signals(exit_code - 128).name
        except ValueError:
            sig = f"signal {exit_code - 128}"
        return Termination(
            "Error", exit_code, f"the kernel was killed by {sig} (exit code {exit_code})"
        )
    return Termination("Error", exit_code, f"the kernel exited with code {exit_code}")
