"""What every model-holding process sets first (runtime.ranks.setup_process): the allocator returns freed tensors'
memory to the OS (malloc_mmap_threshold_kib, runtime.allocator), where glibc's default keeps it in the heap."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

# 8 MiB blocks freed between small blocks that stay (as a step's gradients between later allocations); prints
# the MiB the process's resident set fell by when they were freed
FREE_BETWEEN_KEPT = textwrap.dedent(
    """
    import sys
    from loopline.runtime.allocator import return_freed_memory

    def rss_mib():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS"):
                return int(line.split()[1]) // 1024

    if not return_freed_memory(int(sys.argv[1])) and sys.argv[1] != "0":
        sys.exit("mallopt refused")
    first = bytearray(8 << 20)
    del first  # glibc's own threshold now grows past 8 MiB
    kept, freed = [], []
    for _ in range(40):
        freed.append(bytearray(8 << 20))
        kept.append(bytearray(64 << 10))
    before = rss_mib()
    del freed
    print(before - rss_mib())
    """
)


def _released_mib(kib: int) -> int:
    out = subprocess.run(
        [sys.executable, "-c", FREE_BETWEEN_KEPT, str(kib)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return int(out.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_tensors_memory_leaves_the_process_at_the_threshold():
    assert _released_mib(1024) >= 300  # 320 MiB freed: back to the OS
    assert _released_mib(0) < 100  # glibc's default: kept in the heap (what the setting is for)


def test_no_threshold_leaves_the_allocator_alone():
    from loopline.runtime.allocator import return_freed_memory

    assert return_freed_memory(0) is False
