"""The control plane: a KernelSession rendered into Pods, Services and Secrets, a Pod's
status read back, when a dying kernel starts again, and the kopf handlers of the operator."""
