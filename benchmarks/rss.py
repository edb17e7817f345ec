"""This process's resident memory from /proc (Linux): the high-water mark, its reset, the current size.

The one reader for every peak-memory measurement: the benchmarks' fresh-process peaks
(benchmarks/memory.py) and the tests' (transport, scorer, TRL), which import it from here as
they import the host-read counter (benchmarks/syncs.py).
"""

import re


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1))


def rss_high_water_kib() -> int:
    """VmHWM: the largest resident set since the process started or the last reset."""
    return _status_kib("VmHWM")


def rss_kib() -> int:
    """VmRSS: the resident set now."""
    return _status_kib("VmRSS")


def reset_high_water() -> bool:
    """Set the high-water mark to the current size; False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
