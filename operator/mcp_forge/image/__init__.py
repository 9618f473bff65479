"""Images built with no container registry: the kernel image from Debian packages and
wheels (kernel), and the operator, gateway and egress proxy images from this checkout
(control_plane)."""
