"""Images built with no container registry: the kernel image from Debian packages and
wheels (kernel), and the operator and gateway images from this checkout (control_plane)."""
