"""Ready as soon as the kernel answers: the operator asks a starting kernel itself.

The kubelet runs the kernel container's startupProbe once a second at most, so a kernel
that answers 0.5 s after its start was shown Ready a second later, and only after the
kubelet's next status write. So the operator asks too: told of a kernel pod of a session
that has an IP and has not been seen to answer, it sends one signed kernel_info_request
to the kernel's shell port at that IP (Curve with the Secret's keys, as the gateway
connects; the kernelside probe program, run here) and waits for the reply, which comes
as soon as the kernel serves its socket. The answer's time is then the session's Ready
(control/pods.py `observe`), and the session is looked at at once.

The startupProbe stays: it still kills a kernel that never answers, and a restarted
operator, which remembers no answer, reads the kubelet's Ready. A kernel the operator
cannot reach (a NetworkPolicy of someone else's) is Ready when the kubelet says so, as
before. Bounded: PROBES kernels asked at a time (others wait for the kubelet), each for
PATIENCE seconds, in threads of its own; a reply is at most 64 KiB, 8 queued, and must be
signed with the session's key. Only pods a KernelSession controls are asked, with the
Secret named after the pod.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from mcp_forge.api import status as st
from mcp_forge.api.kernelsession import KIND as KS_KIND
from mcp_forge.clients.kube import Kube, connection_file_of
from mcp_forge.control.pods import kernel_status
from mcp_forge.control.render import LABEL_SESSION, connection_secret_in, connection_secret_of
from mcp_forge.kernelside import probe

log = logging.getLogger(__name__)

PROBES = 16  # kernels asked at once
PATIENCE = 30.0  # seconds a kernel is asked for; the startupProbe allows more
ASK_MS = 2000  # one request's wait: then it is sent again (a kernel may miss the first)

Key = tuple[str, str]  # (namespace, session)


def askable(pod: Mapping[str, Any]) -> bool:
    """A kernel pod whose kernel may be starting: it has an IP, the kubelet has not said
    it answered, it has not ended, and it is not being deleted."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    kernel = kernel_status(pod)
    return (
        isinstance(status.get("podIP"), str)
        and not meta.get("deletionTimestamp")
        and status.get("phase") in (None, "Pending", "Running")
        and not kernel.get("ready")
        and "terminated" not in (kernel.get("state") or {})
    )


def _made_by_a_session(pod: Mapping[str, Any]) -> bool:
    """A pod a KernelSession controls (the operator made or claimed it), not one that
    only carries the labels."""
    refs = (pod.get("metadata") or {}).get("ownerReferences") or []
    return any(r.get("kind") == KS_KIND and r.get("controller") for r in refs)


class Answers:
    """Kernels seen to answer, by session: (pod uid, when). Lives in the event loop;
    `of` may be read from the reconcile threads."""

    def __init__(self, kube: Kube, poke: Callable[[str, str], None]) -> None:
        self.kube = kube
        self.poke = poke
        self._answered: dict[Key, tuple[str, str, str]] = {}  # pod uid, when, its address
        self._asking: dict[Key, tuple[str, asyncio.Task[None]]] = {}
        self._slots = asyncio.Semaphore(PROBES)
        # Its own threads: a probe waits up to ASK_MS, which must not hold up reconciles
        # in the loop's default executor; a cancelled ask's thread still counts here.
        self._threads = concurrent.futures.ThreadPoolExecutor(PROBES, "mcp-forge-ask")

    def of(self, namespace: str, name: str, uid: str | None) -> tuple[str, str] | None:
        """When the kernel of pod `uid` answered the operator, and at which address (a
        pod read from a cache may not show it yet), if it has."""
        seen = self._answered.get((namespace, name))
        if seen is None or uid is None or seen[0] != uid:
            return None
        return seen[1], seen[2]

    def consider(self, pod: Mapping[str, Any]) -> None:
        """A session's kernel pod changed: ask its kernel, if it is starting and not asked."""
        meta = pod.get("metadata") or {}
        namespace, uid = meta.get("namespace"), meta.get("uid")
        name = (meta.get("labels") or {}).get(LABEL_SESSION)
        if not (namespace and uid and name):
            return
        key = (namespace, name)
        asking = self._asking.get(key)
        if not askable(pod) or not _made_by_a_session(pod):
            if asking is not None and asking[0] == uid:  # ready, ended or going: no more
                asking[1].cancel()
            return
        if self.of(namespace, name, uid) is not None:
            return
        if asking is not None and asking[0] == uid:
            return
        secret = connection_secret_in(pod)
        if secret != connection_secret_of(str(meta.get("name") or "")):
            return  # the key of this pod only, never a Secret a pod names at will
        if asking is not None:  # an earlier kernel of the session: no longer of interest
            asking[1].cancel()
        host = str((pod.get("status") or {})["podIP"])
        task = asyncio.create_task(self._ask(key, uid, host, secret), name=f"ask {name}")
        self._asking[key] = (uid, task)

    def forget(self, namespace: str, name: str) -> None:
        """The session is gone."""
        self._answered.pop((namespace, name), None)
        asking = self._asking.pop((namespace, name), None)
        if asking is not None:
            asking[1].cancel()

    async def close(self) -> None:
        tasks = [task for _, task in self._asking.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._threads.shutdown(wait=False)

    async def _ask(self, key: Key, uid: str, host: str, secret: str) -> None:
        namespace, name = key
        try:
            async with self._slots:
                loop = asyncio.get_running_loop()
                get = self.kube.get
                body = await loop.run_in_executor(self._threads, get, "Secret", namespace, secret)
                info = connection_file_of(body)
                if info is None:
                    return
                deadline = time.monotonic() + PATIENCE
                while time.monotonic() < deadline:
                    asked = loop.run_in_executor(self._threads, probe.answers, info, host, ASK_MS)
                    if await asked:
                        self._answered[key] = (uid, st.stamp(), host)
                        self.poke(namespace, name)
                        return
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a Secret unreadable, a malformed file: the kubelet's way
            log.info("kernel of %s/%s not asked: %s", namespace, name, exc)
        finally:
            with contextlib.suppress(KeyError):
                if self._asking[key][0] == uid:
                    del self._asking[key]
