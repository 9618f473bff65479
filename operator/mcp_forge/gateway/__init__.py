"""The gateway: runs code in sessions' kernels for agents. serve is the gateway process
(its wiring), core the execution core (over the kernel client of mcp_forge.jupyter),
introspection its helpers in the kernel, sessions says who owns what; mcp/ is the MCP
front and codemode/ the bridge that lets kernel code call other MCP servers."""
