"""The only modules that talk to Kubernetes (kube) and Podman (podman)."""
