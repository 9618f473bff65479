"""Programs the egress tests run in a kernel (local and cluster alike).

tests/ is on sys.path: `from egress_kernel import holding_search`.
"""

from __future__ import annotations

import hashlib


def holding_search(value: str) -> str:
    """A program printing where the kernel holds `value` (`[]`: nowhere): its environment,
    its files under /workspace and /tmp, and every readable mapping of its memory. The
    kernel is given the value's first half and its digest, never the value."""
    half, digest = value[:16], hashlib.sha256(value.encode()).hexdigest()
    return f"""
import hashlib, os, re
half, digest, size = {half!r}.encode(), {digest!r}, {len(value)}
def holds(data):
    return any(hashlib.sha256(data[i:i + size]).hexdigest() == digest
               for i in (m.start() for m in re.finditer(re.escape(half), data)))
found = []
if holds("\\0".join(f"{{k}}={{v}}" for k, v in os.environ.items()).encode()):
    found.append("environ")
for top in ("/workspace", "/tmp"):
    for root, _, files in os.walk(top):
        for f in files:
            try:
                with open(os.path.join(root, f), "rb") as h:
                    if holds(h.read(50_000_000)):
                        found.append(os.path.join(root, f))
            except OSError:
                pass
with open("/proc/self/maps") as maps, open("/proc/self/mem", "rb", 0) as mem:
    for line in maps:
        span, perms = line.split()[:2]
        if "r" not in perms or line.rstrip().endswith(("[vvar]", "[vsyscall]")):
            continue
        start, end = (int(x, 16) for x in span.split("-"))
        try:
            mem.seek(start)
            if holds(mem.read(end - start)):
                found.append("memory " + span)
        except (OSError, ValueError, OverflowError):
            pass
print(found)
"""
