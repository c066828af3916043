"""How fast this CPU multiplies in bfloat16 against float32: the probe behind training.mixed_precision=auto.

One square matmul (PROBE_SIZE, a size between the 0.5B-1.5B shapes' hidden widths) in each dtype, on one thread
(a run's trainer computes on `threads`, 1 by default), best of a few repeats, about a second in all. Whether bf16
pays depends on the CPU, not on its vector width alone: AMX or avx512_bf16 cores ran bf16 matmuls 4-8x faster than
float32, AVX2-only ones ~17x slower (docs/guide/memory-plan.md). The result is cached per machine under
~/.cache/loopline (or $LOOPLINE_CACHE_DIR), keyed by the CPU's model name, its bf16 flags and the torch version, so
a run reads it without importing torch; `python -m loopline.training.bf16_probe` measures and writes it.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PROBE_SIZE = 1024
# the CPU flags that decide bf16's speed (x86 AVX-512 BF16, AMX; Arm's bf16) and the vector units beside them
KEY_FLAGS = ("avx512_bf16", "amx_bf16", "amx_tile", "bf16", "avx512f", "avx2")


def _cpu() -> tuple[str, list[str]]:
    """This CPU's model name and which of KEY_FLAGS it has (/proc/cpuinfo; empty where unreadable)."""
    model, flags = "unknown", set()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return model, []
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and model == "unknown":
            model = value.strip()
        if key.strip() in ("flags", "Features") and not flags:
            flags = set(value.split())
    return model, [f for f in KEY_FLAGS if f in flags]


def cache_path() -> Path:
    """This machine's probe file: one per (CPU model, bf16 flags, torch version)."""
    model, flags = _cpu()
    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = "none"
    key = hashlib.sha256(f"{model}|{','.join(flags)}|{torch_version}|{PROBE_SIZE}".encode()).hexdigest()[:16]
    root = Path(os.environ.get("LOOPLINE_CACHE_DIR") or Path.home() / ".cache" / "loopline")
    return root / f"bf16-probe-{key}.json"


def cached() -> dict[str, Any] | None:
    """The cached probe of this machine, or None (no torch imported)."""
    try:
        return json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return None


def measure(size: int = PROBE_SIZE, budget_s: float = 1.0) -> dict[str, Any]:
    """GFLOP/s of a (size x size) @ (size x size) matmul in float32 and in bfloat16 on one thread, best of up to
    five repeats per dtype within about `budget_s` seconds each, and their ratio (speedup of bf16)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rates = {}
        for dtype in (torch.float32, torch.bfloat16):
            gen = torch.Generator().manual_seed(0)
            a = torch.randn(size, size, generator=gen).to(dtype)
            b = torch.randn(size, size, generator=gen).to(dtype)
            torch.mm(a, b)  # warm-up: kernel selection, oneDNN's first call
            best, start = float("inf"), time.perf_counter()
            for _ in range(5):
                t0 = time.perf_counter()
                torch.mm(a, b)
                best = min(best, time.perf_counter() - t0)
                if time.perf_counter() - start > budget_s / 2:
                    break
            rates[str(dtype).removeprefix("torch.")] = 2.0 * size**3 / best / 1e9
    finally:
        torch.set_num_threads(threads)
    model, flags = _cpu()
    return {
        "cpu": model,
        "flags": flags,
        "torch": torch.__version__,
        "size": size,
        "float32_gflops": round(rates["float32"], 1),
        "bfloat16_gflops": round(rates["bfloat16"], 1),
        "speedup": round(rates["bfloat16"] / rates["float32"], 2),
    }


def probe() -> dict[str, Any]:
    """This machine's probe: the cached one, else measured in a child process (which writes the cache), so that
    the caller imports no torch and keeps its own thread settings."""
    found = cached()
    if found is not None:
        return found
    out = subprocess.run(
        [sys.executable, "-m", "loopline.training.bf16_probe"], capture_output=True, text=True, timeout=300
    )
    if out.returncode != 0:
        raise RuntimeError(f"the bf16 probe failed: {out.stderr.strip()[-500:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    """Measure, write the cache, print the result as one JSON line."""
    result = measure()
    path = cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(path)  # whole or absent: runs started together may probe at once
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
