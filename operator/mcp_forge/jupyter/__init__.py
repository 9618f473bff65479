"""The Jupyter protocol, spoken by us: one kernel's ZMQ connection (client), the byte relay
that bounds what a kernel can make us hold (relay), and the folding of its messages into
an execution result (execution). Used by the gateway and by local mode's readiness check."""
