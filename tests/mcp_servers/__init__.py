"""Upstream MCP servers for code mode's tests: their configuration and our edge server."""
