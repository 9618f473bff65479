"""A PEP 517 build backend that records what it saw while it ran (package_index.py puts
it, with its settings first, into the sdists it makes as their in-tree backend).

build_wheel writes a pure wheel whose package holds evidence.json: the uid, the user
namespace's uid map, the network interfaces, the environment's names, whether the host's
CANARY file was visible and whether the host path MARKER could be written. Only the
standard library: the build sandbox has no network, and this needs nothing installed.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import zipfile
from typing import Any

# Replaced by the lines package_index.py puts before this module's source.
NAME, VERSION, CANARY, MARKER, IMPORTS = "x", "0", "/nonexistent", "/nonexistent/m", ("",)


def _seen() -> dict[str, Any]:
    for module in IMPORTS:
        if module:
            __import__(module)
    try:
        with open(MARKER, "w") as f:
            f.write("the build ran here")
        marked = True
    except OSError:
        marked = False
    try:
        with open("/proc/self/uid_map") as f:
            uid_map = f.read().split()
    except OSError:
        uid_map = []
    net = "/sys/class/net"
    return {
        "uid": os.getuid(),
        "uid_map": uid_map,
        "interfaces": sorted(os.listdir(net)) if os.path.isdir(net) else None,
        "env": sorted(os.environ),
        "canary_seen": os.path.exists(CANARY),
        "marked": marked,
        "imports": [m for m in IMPORTS if m],
    }


def _dist() -> str:
    return f"{NAME.replace('-', '_')}-{VERSION}.dist-info"


def _metadata() -> dict[str, str]:
    return {
        f"{_dist()}/METADATA": f"Metadata-Version: 2.1\nName: {NAME}\nVersion: {VERSION}\n",
        f"{_dist()}/WHEEL": (
            "Wheel-Version: 1.0\nGenerator: t\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }


def get_requires_for_build_wheel(config_settings: Any = None) -> list[str]:
    return []


def prepare_metadata_for_build_wheel(metadata_directory: str, config_settings: Any = None) -> str:
    _seen()
    for path, text in _metadata().items():
        full = os.path.join(metadata_directory, path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "w") as f:
            f.write(text)
    return _dist()


def build_wheel(
    wheel_directory: str, config_settings: Any = None, metadata_directory: Any = None
) -> str:
    pkg = NAME.replace("-", "_")
    name = f"{pkg}-{VERSION}-py3-none-any.whl"
    files = {
        f"{pkg}/__init__.py": (
            "import json, os\n"
            "EVIDENCE = json.load(open(os.path.join(os.path.dirname(__file__), 'evidence.json')))\n"
        ),
        f"{pkg}/evidence.json": json.dumps(_seen()),
        **_metadata(),
    }
    record = []
    with zipfile.ZipFile(os.path.join(wheel_directory, name), "w") as z:
        for path, text in files.items():
            data = text.encode()
            z.writestr(path, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            record.append(f"{path},sha256={digest.decode()},{len(data)}")
        record.append(f"{_dist()}/RECORD,,")
        z.writestr(f"{_dist()}/RECORD", "\n".join(record) + "\n")
    return name
