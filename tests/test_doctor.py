"""`loopline doctor` through the real entry point: exit 0, every section in order, each line `  name: value`, the
versions of this environment, the bubblewrap line agreeing with the sandbox's own check, Ray started, and every
missing piece listed under [turned off] with what it turns off."""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from loopline.envs.sandbox.commands import bwrap_problem, resolve_python
from loopline.envs.sandbox.config import SandboxConfig

pytestmark = [pytest.mark.slow, pytest.mark.e2e]  # the CLI's entry point, whole runs

SECTIONS = ["versions", "cpu", "gpu", "sandbox", "ray", "logging", "turned off"]


@pytest.fixture(scope="module")
def report() -> dict[str, dict[str, str]]:
    out = subprocess.run(
        [sys.executable, "-m", "loopline.cli", "doctor"],
        capture_output=True,
        text=True,
        timeout=300,
        env=os.environ,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines[0].startswith("loopline doctor")
    sections: dict[str, dict[str, str]] = {}
    for line in lines[1:]:
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        match = re.fullmatch(r"  ([a-z0-9_ -]+): +(\S.*)", line)
        assert match, f"not `  name: value`: {line!r}"
        current[match[1]] = match[2]
    return sections


def test_every_section_in_order_with_this_environments_versions(report) -> None:
    assert list(report) == SECTIONS
    versions = report["versions"]
    assert versions["torch"] == torch.__version__ and versions["transformers"] == transformers.__version__
    assert versions["python"].startswith(platform.python_version() + " (")
    assert re.fullmatch(r"0\.1\.0 \(commit ([0-9a-f]{40}(\+dirty)?|unknown)\)", versions["loopline"])
    assert set(report["cpu"]) >= {"model", "cores", "memory", "avx2", "avx512f", "avx512_bf16", "amx_tile"}
    flags = Path("/proc/cpuinfo").read_text().split()
    assert report["cpu"]["avx512f"] == ("yes" if "avx512f" in flags else "no")
    assert report["cpu"]["cores"].startswith(f"{os.cpu_count()} (")
    assert report["gpu"]["cuda"].startswith(
        "not available" if not torch.cuda.is_available() else torch.version.cuda
    )


def test_bubblewrap_as_the_sandbox_sees_it(report) -> None:
    cfg = SandboxConfig()
    problem = bwrap_problem(resolve_python(cfg.python), tuple(cfg.ro_binds), os.geteuid() == 0)
    line = report["sandbox"]["bubblewrap"]
    assert report["sandbox"]["process fallback"].startswith(("usable (", "not usable: "))
    if problem is None:
        assert line.startswith("usable (") and "bubblewrap" not in report["turned off"]
    else:
        assert line == f"not usable: {problem}"
        assert "isolation=process" in report["turned off"]["bubblewrap"]


def test_ray_starts_and_missing_pieces_say_what_they_turn_off(report) -> None:
    import ray

    assert report["ray"]["ray"] == ray.__version__
    assert report["ray"]["ray start"].startswith("ok: a local Ray started, ran a task in ")
    off = report["turned off"]
    missing = {name for section in SECTIONS[:-1] for name, value in report[section].items() if name in off}
    assert missing == set(off) - {"none"}
    for name in off:
        assert off[name] != "none" and len(off[name]) > 20  # says what is off, not just that


def test_the_bf16_probe_is_reported_as_cached_for_this_machine(report) -> None:
    from loopline.training.bf16_probe import cache_path, cached

    line = report["cpu"]["bf16 probe"]
    probe = cached()  # the doctor measured it (or found it) and cached it under this machine's key
    assert probe is not None and str(cache_path()) in line
    assert line.startswith(f"{probe['speedup']:.2f}x float32 (")
    assert ("auto picks bf16" in line) == (probe["speedup"] >= 1.5)


def test_without_the_k8s_extra_doctor_and_render_agree() -> None:
    """`loopline k8s render` checks its objects against the schemas (jsonschema, kubernetes-validate): without the
    k8s extra it stops with the install line, and doctor lists render among what is off, not as working."""
    hide = "import sys\nfor m in ('kubernetes', 'kubernetes_validate', 'jsonschema'): sys.modules[m] = None\n"
    probe = hide + (
        "from loopline.doctor import logging_items\n"
        "item = logging_items()[-1]\n"
        "print(item.name, '|', item.value, '|', item.off)\n"
        "from loopline.cli import main\n"
        "sys.exit(main(['k8s', 'render']))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, env=os.environ
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert "needs the k8s extra" in out.stderr and "pip install 'loopline[k8s]'" in out.stderr
    name, value, off = out.stdout.strip().splitlines()[-1].split(" | ")
    assert name == "k8s extra" and value == "not installed: kubernetes, kubernetes-validate, jsonschema"
    assert "render" in off and "render works" not in off and "pip install 'loopline[k8s]'" in off
