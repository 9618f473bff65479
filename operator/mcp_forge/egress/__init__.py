"""The egress proxy (issue 28): kernels reach the hosts their session allows, and nothing else.

One process per gateway serves every session: mitmproxy, embedded as a library with one
addon of ours (`addon.py`) that holds only the policy (`api/egress.py` decides). It runs
in a venv of its own (`.venv-egress`: mitmproxy 11.0.2 caps cryptography, pyOpenSSL, h11
and tornado below the gateway's), as an unprivileged user, started and fed by the gateway
(`client.py`) over a socket pair: each session's listening socket comes with its rules, as
a file descriptor, so the proxy needs no right on the host's files. docs/design.md §15
says why mitmproxy, and what was tried.

`protocol.py` is what both sides share and imports nothing but the standard library.
"""
