"""The KernelSession contract: its schema and typed spec, its status, how its kernel is
reached and with which keys. No I/O: everything else builds on these."""
