"""Local mode: KernelSessions in an SQLite store, played with `podman kube play`, each pod
in its own user namespace with its own bounded workspace, kept true by a supervisor."""
