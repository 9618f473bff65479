"""Code mode (docs/bridge.md): kernel code calls the tools of upstream MCP servers through
a bridge the gateway controls, under a per-server policy."""
