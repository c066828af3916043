"""loopline.k8s.client against a real cluster with KubeRay: a one-line RayJob submitted, watched to the end,
its logs read, deleted. Runs only when $KUBECONFIG points at such a cluster (namespace: $LOOPLINE_K8S_NAMESPACE
or default); the image rayproject/ray:2.60.0 must be pullable there."""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

import pytest

from loopline.errors import UserError
from loopline.k8s import client


def tiny_rayjob(name: str, namespace: str) -> dict[str, Any]:
    """A RayJob with a head only that prints 1."""
    head = {
        "name": "ray-head",
        "image": "rayproject/ray:2.60.0",
        "resources": {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"cpu": "1", "memory": "2Gi"}},
    }
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayJob",
        "metadata": {"name": name, "namespace": namespace, "labels": {"app.kubernetes.io/instance": name}},
        "spec": {
            "entrypoint": 'python -c "print(1)"',
            "shutdownAfterJobFinishes": True,
            "ttlSecondsAfterFinished": 600,
            "submissionMode": "K8sJobMode",
            "rayClusterSpec": {
                "rayVersion": "2.60.0",
                "headGroupSpec": {"rayStartParams": {}, "template": {"spec": {"containers": [head]}}},
            },
        },
    }


@pytest.mark.cluster
def test_tiny_rayjob_runs_to_success() -> None:
    if not os.environ.get("KUBECONFIG"):
        pytest.skip("Cluster only: set KUBECONFIG to a cluster with KubeRay to run this")
    namespace = os.environ.get("LOOPLINE_K8S_NAMESPACE") or "default"
    name = f"loopline-test-{uuid.uuid4().hex[:6]}"
    with client.connect() as cluster:
        assert client.submit([tiny_rayjob(name, namespace)], cluster) == [f"rayjob/{name} created"]
        try:
            deadline = time.monotonic() + 600
            state = client.status(name, namespace, cluster)
            while state.get("jobStatus") not in ("SUCCEEDED", "FAILED", "STOPPED") and state.get(
                "jobDeploymentStatus"
            ) not in ("Complete", "Failed", "ValidationFailed"):
                assert time.monotonic() < deadline, f"not done after 10 min: {client.format_status(state)}"
                time.sleep(5)
                state = client.status(name, namespace, cluster)
            assert state.get("jobStatus") == "SUCCEEDED", client.format_status(state)
            assert any(
                line.strip() == "1" for line in client.logs(name, namespace, cluster=cluster).splitlines()
            )
        finally:
            try:
                lines = client.delete(name, namespace, cluster=cluster)
            except UserError:
                lines = []
        assert lines[:1] == [f"rayjob/{name} deleted"]
        deadline = time.monotonic() + 120  # KubeRay's finalizer stops the job first
        with pytest.raises(UserError, match=f"no rayjob/{name}"):
            while time.monotonic() < deadline:
                client.status(name, namespace, cluster)
                time.sleep(2)
