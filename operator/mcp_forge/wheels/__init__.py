"""Wheels for a running kernel, which has no network: resolved and downloaded on the host
under the package policy (fetch.py), by the host's pip kept from the host's own
configuration (pip.py), with source distributions fetched without pip (index.py) and
built in a sandbox (sdist.py)."""
