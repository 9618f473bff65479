"""The harness itself: an operator that crashes fails the test that ran it."""

from __future__ import annotations

import pytest

from .harness import OperatorThread


class _Crashing(OperatorThread):
    def __init__(self, *, after_ready: bool) -> None:
        super().__init__()
        self.after_ready = after_ready

    async def _serve(self) -> None:
        if self.after_ready:
            self.ready_flag.set()
            self.stop_flag.wait(10)
        raise RuntimeError("the operator's loop died")


async def test_an_operator_that_crashes_while_starting_fails_start() -> None:
    op = _Crashing(after_ready=False)
    with pytest.raises(AssertionError, match="the operator crashed: RuntimeError"):
        await op.start(kube=None)  # type: ignore[arg-type]


async def test_an_operator_that_crashes_while_running_fails_stop() -> None:
    op = _Crashing(after_ready=True)
    await op.start(kube=None)  # type: ignore[arg-type]
    with pytest.raises(AssertionError, match="the operator's loop died"):
        await op.stop()
