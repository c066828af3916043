"""The part of `loopline k8s` that talks to a cluster: submit a rendered run (ConfigMap, PersistentVolumeClaim,
KubeRay RayJob), read its status and its driver's logs, delete it. Uses the official `kubernetes` client and
the usual kubeconfig; every failure the user can fix (no kubeconfig, cluster unreachable, not allowed, KubeRay
missing, no such job) is a one-line UserError, never an ApiException traceback.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import urllib3
import yaml
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException
from kubernetes.config.kube_config import new_client_from_config

from loopline.errors import UserError

RAY_GROUP = "ray.io"
RAY_VERSION = "v1"
RAYJOBS = "rayjobs"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
SUBMITTER_CONTAINER = "ray-job-submitter"  # KubeRay's submitter container (its own Job, or a head sidecar)


class Cluster:
    """One cluster's API client (server URL, per-request timeout) and the two APIs loopline uses."""

    def __init__(self, api: k8s.ApiClient, timeout: float | tuple[float, float] = (10.0, 60.0)) -> None:
        self.api = api
        self.server: str = api.configuration.host
        self.timeout = timeout
        self.core = k8s.CoreV1Api(api)
        self.custom = k8s.CustomObjectsApi(api)

    def close(self) -> None:
        self.api.close()

    def call(self, method: Any, *args: Any, text: bool = False, **kwargs: Any) -> Any:
        """Call an API method with this cluster's timeout; its reply as JSON (or text), not as a generated model:
        a newer server's fields, or log bytes that are not UTF-8, cannot fail the model's validation."""
        resp = method(*args, _preload_content=False, _request_timeout=self.timeout, **kwargs)
        try:
            data = resp.data
        finally:
            resp.release_conn()
        if text:
            return data.decode("utf-8", errors="replace")
        return json.loads(data) if data else None

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def errors(self, verb: str, what: str, namespace: str) -> Iterator[None]:
        """Turn an API or connection error raised inside into a one-line UserError naming verb, object, namespace."""
        try:
            yield
        except ApiException as e:
            raise UserError(self.explain(e, verb, what, namespace).replace("\n", " ")) from None
        except urllib3.exceptions.HTTPError as e:
            why = getattr(e, "reason", None) or e
            raise UserError(
                f"cannot reach the Kubernetes API server at {self.server} ({_short(why)}): is the cluster up, "
                "and are the kubeconfig's server and context the right ones?"
            ) from None

    def explain(self, e: ApiException, verb: str, what: str, namespace: str) -> str:
        """The one line for an API error answering `verb what` in `namespace`."""
        status = _status_body(e)
        message = status.get("message") or e.reason or ""
        details = status.get("details") or {}
        where = f"in namespace {namespace} on {self.server}"
        if not e.status:  # no HTTP reply: the client raises TLS failures with status 0
            return f"cannot talk to the Kubernetes API server at {self.server} to {verb} {what}: {_short(e.reason)}"
        if e.status == 401:
            return (
                f"the cluster at {self.server} rejected the kubeconfig's credentials (401 Unauthorized) "
                f"to {verb} {what}: log in again or refresh the credentials"
            )
        if e.status == 403:
            return f"not allowed to {verb} {what} {where} (403 Forbidden): {message}"
        if e.status == 404:
            if details.get("kind") == "namespaces":
                return f"namespace {namespace} does not exist on {self.server} (to {verb} {what})"
            if details.get("name"):
                return f"{what} not found {where}"
            if what.startswith("rayjob"):
                return (
                    f"the cluster at {self.server} has no RayJob resource ({RAYJOBS}.{RAY_GROUP}/{RAY_VERSION}): "
                    "KubeRay is not installed (install the KubeRay operator, then retry)"
                )
            return f"the cluster at {self.server} has no such resource (to {verb} {what}): {message}"
        return f"cannot {verb} {what} {where} ({e.status} {e.reason}): {message}"


def _short(x: object) -> str:
    """An error's text on one line, without urllib3's object reprs."""
    text = str(x).replace("\n", " ")
    if "Errno" in text:  # NewConnectionError("...: [Errno 111] Connection refused") -> "[Errno 111] ..."
        text = text[text.index("[Errno") :].rstrip("\")'")
    return text


def _status_body(e: ApiException) -> dict[str, Any]:
    """The Status object the API server returned with an error, or {} (a plain-text body, none at all)."""
    try:
        body = json.loads(e.body) if e.body else {}
    except (TypeError, ValueError):
        return {}
    return body if isinstance(body, dict) else {}


def _kubeconfig(kubeconfig: str | None) -> str:
    """The kubeconfig to load: the argument, else $KUBECONFIG (a path list), else ~/.kube/config."""
    if kubeconfig:
        paths = [kubeconfig]
    elif os.environ.get("KUBECONFIG"):
        paths = [p for p in os.environ["KUBECONFIG"].split(os.pathsep) if p]
    else:
        paths = ["~/.kube/config"]
    found = [os.path.expanduser(p) for p in paths if os.path.exists(os.path.expanduser(p))]
    if not found:
        raise UserError(
            f"kubeconfig {os.pathsep.join(paths)} does not exist: give another with --kubeconfig, set KUBECONFIG or create "
            "~/.kube/config (e.g. with your cloud's `get-credentials` command)"
        )
    return os.pathsep.join(found)


def connect(
    kubeconfig: str | None = None,
    context: str | None = None,
    timeout: float | tuple[float, float] = (10.0, 60.0),
    retries: int = 2,
) -> Cluster:
    """Load the kubeconfig (argument, else $KUBECONFIG, else ~/.kube/config) and its context (or the current
    one). `timeout`: seconds per request, or (connect, read); `retries`: connection attempts after the first."""
    path = _kubeconfig(kubeconfig)
    configuration = k8s.Configuration()
    # urllib3's default retries any error 3 times; here only failed connections, never a POST that was sent
    configuration.retries = urllib3.Retry(
        total=retries, connect=retries, read=0, status=0, other=0, redirect=0, backoff_factor=0.1
    )
    try:
        api = new_client_from_config(
            config_file=path, context=context, persist_config=False, client_configuration=configuration
        )
    except (ConfigException, OSError, yaml.YAMLError, KeyError, TypeError, AttributeError) as e:
        raise UserError(f"cannot load kubeconfig {path}: {_short(e)}") from None
    return Cluster(api, timeout)


def _cluster(cluster: Cluster | None) -> Cluster:
    return cluster if cluster is not None else connect()


# ---------------------------------------------------------------------------------------------------------
# submit
# ---------------------------------------------------------------------------------------------------------


def _meta(obj: dict[str, Any]) -> tuple[str, str]:
    meta = obj.get("metadata") or {}
    return meta["name"], meta.get("namespace") or "default"


def _get_rayjob(c: Cluster, name: str, namespace: str) -> dict[str, Any] | None:
    """The RayJob `name`, or None when there is none (a missing CRD is an error, not None)."""
    with c.errors("get", f"rayjob/{name}", namespace):
        try:
            return c.call(
                c.custom.get_namespaced_custom_object, RAY_GROUP, RAY_VERSION, namespace, RAYJOBS, name
            )
        except ApiException as e:
            if e.status == 404 and (_status_body(e).get("details") or {}).get("name") == name:
                return None
            raise


def _exists_error(name: str, namespace: str) -> UserError:
    return UserError(
        f"rayjob/{name} already exists in namespace {namespace}: delete it first with "
        f"`loopline k8s delete {name}`"
    )


def submit(objects: list[dict[str, Any]], cluster: Cluster | None = None) -> list[str]:
    """Create the rendered objects in order: a ConfigMap is replaced if it exists, an existing PVC is kept, an
    existing RayJob is an error (checked before anything is written). One line per object."""
    c = _cluster(cluster)
    for obj in objects:  # before the ConfigMap is replaced under a job that is still running
        if obj.get("kind") == "RayJob" and _get_rayjob(c, *_meta(obj)) is not None:
            raise _exists_error(*_meta(obj))
    lines = []
    for obj in objects:
        kind = obj.get("kind")
        name, namespace = _meta(obj)
        if kind == "ConfigMap":
            with c.errors("create", f"configmap/{name}", namespace):
                try:
                    c.call(c.core.create_namespaced_config_map, namespace, obj)
                    lines.append(f"configmap/{name} created")
                except ApiException as e:
                    if e.status != 409:
                        raise
                    c.call(c.core.replace_namespaced_config_map, name, namespace, obj)
                    lines.append(f"configmap/{name} replaced")
        elif kind == "PersistentVolumeClaim":
            with c.errors("create", f"persistentvolumeclaim/{name}", namespace):
                try:
                    c.call(c.core.create_namespaced_persistent_volume_claim, namespace, obj)
                    lines.append(f"persistentvolumeclaim/{name} created")
                except ApiException as e:
                    if e.status != 409:
                        raise
                    lines.append(f"persistentvolumeclaim/{name} exists, kept (the run resumes from it)")
        elif kind == "RayJob":
            with c.errors("create", f"rayjob/{name}", namespace):
                try:
                    c.call(
                        c.custom.create_namespaced_custom_object,
                        RAY_GROUP,
                        RAY_VERSION,
                        namespace,
                        RAYJOBS,
                        obj,
                    )
                except ApiException as e:
                    if e.status == 409:
                        raise _exists_error(name, namespace) from None
                    raise
            lines.append(f"rayjob/{name} created")
        else:
            raise ValueError(
                f"cannot submit a {kind} ({name}): only ConfigMap, PersistentVolumeClaim, RayJob"
            )
    return lines


# ---------------------------------------------------------------------------------------------------------
# status
# ---------------------------------------------------------------------------------------------------------

STATUS_FIELDS = (
    "jobDeploymentStatus",
    "jobStatus",
    "reason",
    "message",
    "rayClusterName",
    "jobId",
    "startTime",
    "endTime",
    "succeeded",
    "failed",
    "dashboardURL",
)


def _require_rayjob(c: Cluster, name: str, namespace: str) -> dict[str, Any]:
    job = _get_rayjob(c, name, namespace)
    if job is None:
        raise UserError(f"no rayjob/{name} in namespace {namespace} on {c.server}")
    return job


def _flat_status(job: dict[str, Any]) -> dict[str, Any]:
    meta, spec, st = job.get("metadata") or {}, job.get("spec") or {}, job.get("status") or {}
    out: dict[str, Any] = {"name": meta.get("name"), "namespace": meta.get("namespace")}
    out["suspended"] = bool(spec.get("suspend", False))
    queue = (meta.get("labels") or {}).get(QUEUE_LABEL)
    if queue:
        out["queue"] = queue
    out.update({k: st[k] for k in STATUS_FIELDS if st.get(k) not in (None, "")})
    return out


def status(name: str, namespace: str, cluster: Cluster | None = None) -> dict[str, Any]:
    """The RayJob's state as a flat dict: name, namespace, suspended, queue (Kueue) and the status fields set."""
    return _flat_status(_require_rayjob(_cluster(cluster), name, namespace))


def format_status(d: dict[str, Any]) -> str:
    """One line: "NAME: Running (job RUNNING) on cluster C", "NAME: Suspended (queued by Kueue in q)"."""
    deploy = d.get("jobDeploymentStatus") or ""
    if d.get("suspended") and deploy in ("", "New", "Suspending", "Suspended"):
        state = "Suspended (queued by Kueue in " + d["queue"] + ")" if d.get("queue") else "Suspended"
    else:
        state = deploy or "Pending (no status yet)"
        if d.get("jobStatus"):
            state += f" (job {d['jobStatus']})"
    line = f"{d.get('name')}: {state}"
    if d.get("rayClusterName"):
        line += f" on cluster {d['rayClusterName']}"
    why = "; ".join(str(d[k]) for k in ("reason", "message") if d.get(k))
    if why:
        line += f": {why}"
    return line.replace("\n", " ")


# ---------------------------------------------------------------------------------------------------------
# logs
# ---------------------------------------------------------------------------------------------------------


def _pods(c: Cluster, namespace: str, selector: str) -> list[dict[str, Any]]:
    """Pods matching the label selector, newest first."""
    with c.errors("list", f"pods ({selector})", namespace):
        pods = c.call(c.core.list_namespaced_pod, namespace, label_selector=selector)["items"]
    return sorted(pods, key=lambda p: p["metadata"].get("creationTimestamp") or "", reverse=True)


def _pod_log(c: Cluster, pod: dict[str, Any], namespace: str, tail_lines: int | None) -> str:
    """The pod's log: its submitter container if it has one (SidecarMode), else its first (the Ray head's)."""
    name = pod["metadata"]["name"]
    containers = [ct["name"] for ct in (pod.get("spec") or {}).get("containers") or []]
    container = SUBMITTER_CONTAINER if SUBMITTER_CONTAINER in containers else (containers or [None])[0]
    with c.errors("read logs of", f"pod/{name}", namespace):
        return c.call(
            c.core.read_namespaced_pod_log,
            name,
            namespace,
            container=container,
            tail_lines=tail_lines,
            text=True,
        )


def logs(name: str, namespace: str, tail_lines: int | None = None, cluster: Cluster | None = None) -> str:
    """The driver's logs: the newest pod of the submitter Job (K8sJobMode), else the head pod of the RayJob's
    Ray cluster. UserError when neither exists yet (the job is suspended, queued or starting)."""
    c = _cluster(cluster)
    pods = _pods(c, namespace, f"job-name={name}")
    if not pods:
        d = _flat_status(_require_rayjob(c, name, namespace))
        if d.get("rayClusterName"):
            pods = _pods(c, namespace, f"ray.io/cluster={d['rayClusterName']},ray.io/node-type=head")
        if not pods:
            raise UserError(
                f"rayjob/{name} has not started yet, no pod to read logs from ({format_status(d)})"
            )
    return _pod_log(c, pods[0], namespace, tail_lines)


# ---------------------------------------------------------------------------------------------------------
# delete
# ---------------------------------------------------------------------------------------------------------


def _deleted(c: Cluster, what: str, namespace: str, call: Any, *args: Any) -> bool:
    """Run a delete call; False when the object was not there."""
    with c.errors("delete", what, namespace):
        try:
            c.call(call, *args, propagation_policy="Background")
        except ApiException as e:
            if e.status == 404 and (_status_body(e).get("details") or {}).get("name"):
                return False
            raise
    return True


def delete(name: str, namespace: str, storage: bool = False, cluster: Cluster | None = None) -> list[str]:
    """Delete the RayJob (KubeRay deletes its Ray cluster) and its ConfigMap; its PVC `<name>-runs` (the
    checkpoints) only with storage=True. One line per object; UserError when none of them existed."""
    c = _cluster(cluster)
    targets = [
        (
            f"rayjob/{name}",
            c.custom.delete_namespaced_custom_object,
            (RAY_GROUP, RAY_VERSION, namespace, RAYJOBS, name),
        ),
        (f"configmap/{name}-config", c.core.delete_namespaced_config_map, (f"{name}-config", namespace)),
    ]
    claim = f"persistentvolumeclaim/{name}-runs"
    if storage:
        targets.append((claim, c.core.delete_namespaced_persistent_volume_claim, (f"{name}-runs", namespace)))
    lines, found = [], 0
    for what, call, args in targets:
        ok = _deleted(c, what, namespace, call, *args)
        found += ok
        lines.append(f"{what} deleted" if ok else f"{what} not found")
    claim_kept = False
    if not storage:
        with c.errors("get", claim, namespace):
            try:
                c.call(c.core.read_namespaced_persistent_volume_claim, f"{name}-runs", namespace)
                claim_kept = True
                lines.append(f"{claim} kept (it holds the run's checkpoints)")
            except ApiException as e:
                if e.status != 404:
                    raise
    if not found:
        kept = (
            f" ({claim} remains: it holds the checkpoints, deleted only with --storage)" if claim_kept else ""
        )
        raise UserError(f"nothing to delete: no rayjob/{name} or its objects in namespace {namespace}{kept}")
    return lines
