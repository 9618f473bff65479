from mcp_forge.cli import main

main()
