module mcpforge.dev/runc-restore

go 1.25
