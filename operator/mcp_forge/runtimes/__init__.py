"""Where KernelSessions are realized: the protocol the gateway sees (base), local mode
(local/: an embedded store and Podman) and a cluster through the API server (cluster)."""
