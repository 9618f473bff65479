"""The example sessions in manifests/examples and the GitOps examples (Argo CD, Flux)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from manifests_support import EXAMPLES, MANIFESTS, SESSIONS, kustomize

from mcp_forge.api import kernelsession
from mcp_forge.errors import InvalidSession

# ---- the example sessions --------------------------------------------------------------------


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_every_example_is_a_valid_kernel_session(path: Path) -> None:
    for body in kernelsession.parse_documents(path.read_text()):
        assert body["metadata"]["namespace"] in ("default", SESSIONS)


def test_the_gitops_example_suspends_when_idle_and_keeps_its_updates_for_a_restart() -> None:
    (body,) = kernelsession.parse_documents((MANIFESTS / "examples" / "gitops.yaml").read_text())
    spec = body["spec"]
    assert spec["idleAction"] == "Suspend"
    assert spec["operatingMode"] == "Running"
    assert spec["updateStrategy"] == "OnRestart"
    assert body["metadata"]["namespace"] == SESSIONS


def _gitops(**spec: Any) -> dict[str, Any]:
    (body,) = yaml.safe_load_all((MANIFESTS / "examples" / "gitops.yaml").read_text())
    body["spec"].update(spec)
    return dict(body)


@pytest.mark.parametrize(
    ("body", "field", "words"),
    [
        (_gitops(idleAction="Hibernate"), "spec.idleAction", "one of Delete, Suspend"),
        (_gitops(operatingMode="Paused"), "spec.operatingMode", "one of Running, Suspended"),
        (_gitops(updateStrategy="Now"), "spec.updateStrategy", "one of OnRestart, Recreate"),
        (_gitops(maxLifetime="1 day"), "spec.maxLifetime", "pattern"),
        (_gitops(resources={"memory": "2GB"}), "spec.resources.memory", "pattern"),
        (_gitops(idleActions="Suspend"), "spec.idleActions", "unknown field"),
    ],
    ids=["idleAction", "operatingMode", "updateStrategy", "maxLifetime", "memory", "typo"],
)
def test_an_invalid_variant_of_an_example_is_rejected_naming_the_field(
    body: dict[str, Any], field: str, words: str
) -> None:
    with pytest.raises(InvalidSession) as err:
        kernelsession.validate(body)
    assert err.value.field == field
    assert words in str(err.value)


GITOPS = MANIFESTS / "examples" / "gitops"


def test_the_gitops_examples_sync_what_the_repository_has() -> None:
    """Argo CD Applications and Flux Kustomizations point at directories that exist and
    build; the sessions folder holds valid KernelSessions that suspend when idle (not
    delete: auto-sync would make them again); the CRDs go apart, never pruned."""
    root = MANIFESTS.parent
    paths = {}
    for doc in (GITOPS / "argocd").glob("*.yaml"):
        (app,) = yaml.safe_load_all(doc.read_text())
        assert app["kind"] == "Application", doc
        paths[app["metadata"]["name"]] = app["spec"]["source"]["path"]
        assert "ServerSideApply=true" in app["spec"]["syncPolicy"]["syncOptions"], doc
    for doc in (GITOPS / "flux").glob("*.yaml"):
        for obj in yaml.safe_load_all(doc.read_text()):
            if obj["kind"] == "Kustomization":
                paths[obj["metadata"]["name"]] = obj["spec"]["path"].removeprefix("./")
                assert obj["spec"]["wait"] is True, doc
    assert set(paths.values()) == {"crds", "manifests/base", "manifests/examples/gitops/sessions"}
    for path in paths.values():
        assert kustomize(root / path), path
    sessions = kustomize(GITOPS / "sessions")
    for body in sessions:
        (session,) = kernelsession.parse_documents(yaml.safe_dump(body))
        assert session["spec"]["idleAction"] == "Suspend", body["metadata"]["name"]
    for crd in kustomize(root / "crds"):
        notes = crd["metadata"]["annotations"]
        assert notes["argocd.argoproj.io/sync-options"] == "Prune=false,Delete=false"
        assert notes["kustomize.toolkit.fluxcd.io/prune"] == "disabled"
