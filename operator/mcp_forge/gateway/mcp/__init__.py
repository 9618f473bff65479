"""The gateway as an MCP server (stdio and streamable HTTP), and the HTTP bearer tokens."""
