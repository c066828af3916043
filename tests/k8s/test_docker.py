"""The image recipe agrees with the project: the torch that scripts/setup pins, the Ray version the rendered
RayCluster declares, and paths that exist (no image is built here: no registry can be reached)."""

from __future__ import annotations

import re
from pathlib import Path

from loopline.k8s.config import K8sConfig

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "docker" / "Dockerfile").read_text()


def _arg(name: str) -> str:
    match = re.search(rf"^ARG {name}=(\S+)$", DOCKERFILE, re.M)
    assert match, f"docker/Dockerfile has no ARG {name}=..."
    return match.group(1)


def test_the_image_pins_the_torch_of_scripts_setup_and_the_ray_of_the_rendered_cluster():
    setup = (ROOT / "scripts" / "setup").read_text()
    pinned = re.search(r"LOOPLINE_TORCH_VERSION:-([0-9.]+)", setup)
    assert pinned and _arg("TORCH_VERSION") == pinned.group(1)
    assert _arg("RAY_VERSION") == K8sConfig().ray_version
    assert '"torch==${TORCH_VERSION}"' in DOCKERFILE and '"ray[default]==${RAY_VERSION}"' in DOCKERFILE


def test_the_image_copies_what_exists_and_installs_the_sandbox():
    for source in re.findall(r"^COPY (.+) \S+$", DOCKERFILE, re.M):
        for path in source.split():
            assert (ROOT / path).exists(), path
    assert "bubblewrap" in DOCKERFILE
