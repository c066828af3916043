"""loopline.k8s.client through the real `kubernetes` client over HTTP, against a fake API server on loopback:
just the endpoints the client uses, objects kept in a dict, Status bodies for 404/409/403 as the real one sends."""

from __future__ import annotations

import copy
import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import pytest
import yaml

from loopline.errors import UserError
from loopline.k8s import client

TOKEN = "t0ken"
NS = "ml"
NAME = "loopline-x"
PATH = re.compile(r"^/(api/v1|apis/[^/]+/[^/]+)/namespaces/([^/]+)/([^/]+)(?:/([^/]+))?(?:/(log))?$")


class FakeCluster:
    """The API server's state: objects by (group/version, resource, namespace, name), the requests seen,
    pod logs, and switches for a missing resource type (a CRD not installed) or a forbidden verb."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str, str], dict[str, Any]] = {}
        self.requests: list[tuple[str, str, Any]] = []  # (method, path?query, JSON body or None)
        self.logs: dict[str, str] = {}  # pod name -> its log
        self.missing: set[str] = set()  # resources the server does not know (404 page not found)
        self.forbidden: set[tuple[str, str]] = set()  # (HTTP method, resource) -> 403
        self.lock = threading.Lock()
        self.url = ""

    def put(self, gv: str, resource: str, obj: dict[str, Any]) -> None:
        meta = obj["metadata"]
        self.objects[(gv, resource, meta.get("namespace", NS), meta["name"])] = obj

    def get(self, gv: str, resource: str, name: str, namespace: str = NS) -> dict[str, Any] | None:
        return self.objects.get((gv, resource, namespace, name))

    def rayjob(self, name: str = NAME) -> dict[str, Any] | None:
        return self.get("apis/ray.io/v1", "rayjobs", name)

    def paths(self, method: str) -> list[str]:
        return [p for m, p, _ in self.requests if m == method]


def _status(code: int, reason: str, message: str, details: dict[str, Any] | None = None) -> dict[str, Any]:
    body = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message}
    return {**body, "reason": reason, "details": details or {}, "code": code}


def _matches(obj: dict[str, Any], selector: str) -> bool:
    labels = obj["metadata"].get("labels") or {}
    return all(labels.get(k) == v for k, v in (term.split("=", 1) for term in selector.split(",") if term))


def _handler(fake: FakeCluster) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def _send(self, code: int, body: Any, content_type: str = "application/json") -> None:
            data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _handle(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length)) if length else None
            url = urlsplit(self.path)
            query = {k: v[0] for k, v in parse_qs(url.query).items()}
            with fake.lock:
                fake.requests.append((self.command, self.path, body))
                code, reply, ctype = self._route(url.path, query, body)
            self._send(code, reply, ctype)

        def _route(self, path: str, query: dict[str, str], body: Any) -> tuple[int, Any, str]:
            if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                return 401, _status(401, "Unauthorized", "Unauthorized"), "application/json"
            m = PATH.match(path)
            if not m or m.group(3) in fake.missing:
                return 404, "404 page not found\n", "text/plain"
            gv, ns, resource, name, log = m.groups()
            if (self.command, resource) in fake.forbidden:
                verb = {"POST": "create", "GET": "get", "PUT": "update", "DELETE": "delete"}[self.command]
                group = gv.split("/")[1] if gv.startswith("apis/") else ""
                msg = (
                    f'{resource}{"." if group else ""}{group} is forbidden: User "tester" cannot {verb} resource "{resource}" '
                    f'in API group "{group}" in the namespace "{ns}"'
                )
                return 403, _status(403, "Forbidden", msg, {"kind": resource}), "application/json"
            key = (gv, resource, ns, name)
            not_found = _status(
                404, "NotFound", f'{resource} "{name}" not found', {"name": name, "kind": resource}
            )
            if name is None and self.command == "GET":
                items = [
                    o
                    for (g, r, n, _), o in fake.objects.items()
                    if (g, r, n) == (gv, resource, ns) and _matches(o, query.get("labelSelector", ""))
                ]
                return (
                    200,
                    {"kind": "List", "apiVersion": "v1", "metadata": {}, "items": items},
                    "application/json",
                )
            if name is None and self.command == "POST":
                key = (gv, resource, ns, body["metadata"]["name"])
                if key in fake.objects:
                    msg = f'{resource} "{key[3]}" already exists'
                    return (
                        409,
                        _status(409, "AlreadyExists", msg, {"name": key[3], "kind": resource}),
                        "application/json",
                    )
                stored = copy.deepcopy(body)
                stored["metadata"].update(
                    uid=f"uid-{len(fake.objects)}", creationTimestamp="2025-01-01T00:00:00Z"
                )
                fake.objects[key] = stored
                return 201, stored, "application/json"
            if key not in fake.objects:
                return 404, not_found, "application/json"
            if log:
                text = fake.logs.get(name, "")
                if "tailLines" in query:
                    text = "".join(text.splitlines(keepends=True)[-int(query["tailLines"]) :])
                return 200, text, "text/plain"
            if self.command == "GET":
                return 200, fake.objects[key], "application/json"
            if self.command == "PUT":
                fake.objects[key] = body
                return 200, body, "application/json"
            if (
                self.command == "DELETE"
            ):  # a PVC (finalizers) comes back as the object, a ConfigMap as a Status
                gone = fake.objects.pop(key)
                if resource != "configmaps":
                    return 200, gone, "application/json"
                ok = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success"}
                return 200, {**ok, "details": {"name": name, "kind": resource}}, "application/json"
            return 405, _status(405, "MethodNotAllowed", self.command), "application/json"

        do_GET = do_POST = do_PUT = do_DELETE = _handle

    return Handler


def _kubeconfig(path: Path, server: str) -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {"name": "fake", "cluster": {"server": server, "insecure-skip-tls-verify": True}}
                ],
                "users": [{"name": "tester", "user": {"token": TOKEN}}],
                "contexts": [
                    {"name": "fake", "context": {"cluster": "fake", "user": "tester", "namespace": NS}}
                ],
                "current-context": "fake",
            }
        )
    )
    return path


@pytest.fixture
def fake() -> Iterator[FakeCluster]:
    state = FakeCluster()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    server.daemon_threads = True
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield state
    server.shutdown()
    server.server_close()


@pytest.fixture
def cluster(fake: FakeCluster, tmp_path: Path) -> Iterator[client.Cluster]:
    with client.connect(str(_kubeconfig(tmp_path / "kubeconfig", fake.url)), timeout=5.0) as c:
        yield c


def rendered(name: str = NAME, queue: str | None = None) -> list[dict[str, Any]]:
    """What `loopline k8s render` gives: ConfigMap, PVC, RayJob (its spec cut short)."""
    labels = {"app.kubernetes.io/name": "loopline", "app.kubernetes.io/instance": name}
    meta = {"namespace": NS, "labels": labels}
    job_labels = {**labels, "kueue.x-k8s.io/queue-name": queue} if queue else labels
    spec: dict[str, Any] = {
        "entrypoint": "loopline train /etc/loopline/run.yaml --resume",
        "submissionMode": "K8sJobMode",
    }
    if queue:
        spec["suspend"] = True
    spec["rayClusterSpec"] = {"rayVersion": "2.60.0", "headGroupSpec": {"rayStartParams": {}, "template": {}}}
    return [
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": f"{name}-config", **meta},
            "data": {"run.yaml": "seed: 1\n"},
        },
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": f"{name}-runs", **meta},
            "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "100Gi"}}},
        },
        {
            "apiVersion": "ray.io/v1",
            "kind": "RayJob",
            "metadata": {"name": name, "namespace": NS, "labels": job_labels},
            "spec": spec,
        },
    ]


def pod(
    name: str, labels: dict[str, str], created: str, containers: tuple[str, ...] = ("main",)
) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "labels": labels, "creationTimestamp": created},
        "spec": {"containers": [{"name": c, "image": "rayproject/ray:2.60.0"} for c in containers]},
    }


def test_submit_creates_the_three_objects(fake: FakeCluster, cluster: client.Cluster) -> None:
    objects = rendered()
    lines = client.submit(objects, cluster)
    assert lines == [
        f"configmap/{NAME}-config created",
        f"persistentvolumeclaim/{NAME}-runs created",
        f"rayjob/{NAME} created",
    ]
    assert fake.paths("POST") == [
        f"/api/v1/namespaces/{NS}/configmaps",
        f"/api/v1/namespaces/{NS}/persistentvolumeclaims",
        f"/apis/ray.io/v1/namespaces/{NS}/rayjobs",
    ]
    posted = [body for method, _, body in fake.requests if method == "POST"]
    assert posted == objects  # sent as rendered, nothing dropped or renamed on the way through the client
    assert fake.get("api/v1", "configmaps", f"{NAME}-config")["data"] == {"run.yaml": "seed: 1\n"}
    assert fake.rayjob()["spec"]["entrypoint"] == "loopline train /etc/loopline/run.yaml --resume"


def test_submit_again_replaces_config_keeps_claim_and_refuses_a_second_rayjob(
    fake: FakeCluster, cluster: client.Cluster
) -> None:
    client.submit(rendered(), cluster)
    fake.objects.pop(("apis/ray.io/v1", "rayjobs", NS, NAME))  # deleted by hand: the ConfigMap and PVC remain
    changed = rendered()
    changed[0]["data"] = {"run.yaml": "seed: 2\n"}
    assert client.submit(changed, cluster) == [
        f"configmap/{NAME}-config replaced",
        f"persistentvolumeclaim/{NAME}-runs exists, kept (the run resumes from it)",
        f"rayjob/{NAME} created",
    ]
    assert f"/api/v1/namespaces/{NS}/configmaps/{NAME}-config" in fake.paths("PUT")
    assert fake.get("api/v1", "configmaps", f"{NAME}-config")["data"] == {"run.yaml": "seed: 2\n"}

    before = len(fake.paths("POST")) + len(fake.paths("PUT"))
    with pytest.raises(
        UserError, match=rf"rayjob/{NAME} already exists in namespace {NS}.*`loopline k8s delete {NAME}`"
    ):
        client.submit(rendered(), cluster)
    assert len(fake.paths("POST")) + len(fake.paths("PUT")) == before  # checked before anything was written


def test_status_suspended_then_running(fake: FakeCluster, cluster: client.Cluster) -> None:
    client.submit(rendered(queue="team-a"), cluster)
    fake.rayjob()["status"] = {"jobDeploymentStatus": "Suspended"}
    d = client.status(NAME, NS, cluster)
    assert d["suspended"] is True and d["queue"] == "team-a" and d["jobDeploymentStatus"] == "Suspended"
    assert client.format_status(d) == f"{NAME}: Suspended (queued by Kueue in team-a)"

    fake.rayjob()["spec"]["suspend"] = False
    fake.rayjob()["status"] = {
        "jobDeploymentStatus": "Running",
        "jobStatus": "RUNNING",
        "rayClusterName": f"{NAME}-abcde",
        "jobId": f"{NAME}-xyz",
        "startTime": "2025-01-01T00:00:05Z",
        "dashboardURL": f"{NAME}-abcde-head-svc.{NS}.svc.cluster.local:8265",
        "failed": 0,
    }
    d = client.status(NAME, NS, cluster)
    assert d["suspended"] is False and d["jobStatus"] == "RUNNING" and d["failed"] == 0
    assert d["startTime"] == "2025-01-01T00:00:05Z" and "endTime" not in d
    assert client.format_status(d) == f"{NAME}: Running (job RUNNING) on cluster {NAME}-abcde"
    assert fake.paths("GET")[-1] == f"/apis/ray.io/v1/namespaces/{NS}/rayjobs/{NAME}"

    with pytest.raises(UserError, match=f"no rayjob/other in namespace {NS}"):
        client.status("other", NS, cluster)


def test_logs_from_submitter_else_head_else_not_started(fake: FakeCluster, cluster: client.Cluster) -> None:
    client.submit(rendered(queue="team-a"), cluster)
    with pytest.raises(UserError, match=f"rayjob/{NAME} has not started yet.*Suspended"):
        client.logs(NAME, NS, cluster=cluster)

    fake.rayjob()["status"] = {"jobDeploymentStatus": "Running", "rayClusterName": f"{NAME}-abcde"}
    head = {"ray.io/cluster": f"{NAME}-abcde", "ray.io/node-type": "head"}
    fake.put(
        "api/v1", "pods", pod(f"{NAME}-abcde-head", head, "2025-01-01T00:00:00Z", ("ray-head", "sidecar"))
    )
    fake.put(
        "api/v1",
        "pods",
        pod("unrelated", {"ray.io/cluster": "other", "ray.io/node-type": "head"}, "2025-01-02T00:00:00Z"),
    )
    fake.logs[f"{NAME}-abcde-head"] = "head started\n"
    assert client.logs(NAME, NS, cluster=cluster) == "head started\n"
    selector = f"labelSelector=ray.io/cluster={NAME}-abcde,ray.io/node-type=head"
    assert f"/api/v1/namespaces/{NS}/pods?{selector}" in map(unquote, fake.paths("GET"))
    assert fake.paths("GET")[-1].endswith("/log?container=ray-head")  # the first container, not the sidecar

    fake.put("api/v1", "pods", pod(f"{NAME}-old", {"job-name": NAME}, "2025-01-01T00:00:00Z"))
    fake.put(
        "api/v1",
        "pods",
        pod(f"{NAME}-new", {"job-name": NAME}, "2025-01-01T01:00:00Z", ("ray-job-submitter",)),
    )
    fake.logs[f"{NAME}-old"] = "first try\n"
    fake.logs[f"{NAME}-new"] = "line 1\nline 2\nline 3\n"
    assert client.logs(NAME, NS, cluster=cluster) == "line 1\nline 2\nline 3\n"
    assert client.logs(NAME, NS, tail_lines=1, cluster=cluster) == "line 3\n"
    assert (
        fake.paths("GET")[-1]
        == f"/api/v1/namespaces/{NS}/pods/{NAME}-new/log?container=ray-job-submitter&tailLines=1"
    )


def test_delete_with_and_without_storage(fake: FakeCluster, cluster: client.Cluster) -> None:
    client.submit(rendered(), cluster)
    assert client.delete(NAME, NS, cluster=cluster) == [
        f"rayjob/{NAME} deleted",
        f"configmap/{NAME}-config deleted",
        f"persistentvolumeclaim/{NAME}-runs kept (it holds the run's checkpoints)",
    ]
    assert fake.paths("DELETE") == [
        f"/apis/ray.io/v1/namespaces/{NS}/rayjobs/{NAME}?propagationPolicy=Background",
        f"/api/v1/namespaces/{NS}/configmaps/{NAME}-config?propagationPolicy=Background",
    ]
    assert fake.get("api/v1", "persistentvolumeclaims", f"{NAME}-runs") is not None
    with pytest.raises(UserError, match=f"nothing to delete: no rayjob/{NAME}.*{NAME}-runs remains"):
        client.delete(NAME, NS, cluster=cluster)

    client.submit(rendered(), cluster)
    fake.objects.pop(("api/v1", "configmaps", NS, f"{NAME}-config"))
    assert client.delete(NAME, NS, storage=True, cluster=cluster) == [
        f"rayjob/{NAME} deleted",
        f"configmap/{NAME}-config not found",
        f"persistentvolumeclaim/{NAME}-runs deleted",
    ]
    assert fake.objects == {}
    with pytest.raises(
        UserError, match=f"nothing to delete: no rayjob/{NAME} or its objects in namespace {NS}$"
    ):
        client.delete(NAME, NS, storage=True, cluster=cluster)


def test_kuberay_not_installed(fake: FakeCluster, cluster: client.Cluster) -> None:
    fake.missing.add("rayjobs")
    for call in (lambda: client.submit(rendered(), cluster), lambda: client.status(NAME, NS, cluster)):
        with pytest.raises(UserError, match=rf"{fake.url} has no RayJob resource .*KubeRay is not installed"):
            call()
    assert fake.objects == {}  # submit stopped before creating the ConfigMap


def test_forbidden_names_verb_object_and_namespace(fake: FakeCluster, cluster: client.Cluster) -> None:
    fake.forbidden.add(("POST", "persistentvolumeclaims"))
    with pytest.raises(UserError) as e:
        client.submit(rendered(), cluster)
    msg = str(e.value)
    assert msg.startswith(
        f"not allowed to create persistentvolumeclaim/{NAME}-runs in namespace {NS} on {fake.url}"
    )
    assert "403 Forbidden" in msg and 'User "tester" cannot create' in msg and "\n" not in msg


def test_bad_credentials(fake: FakeCluster, tmp_path: Path) -> None:
    path = _kubeconfig(tmp_path / "kubeconfig", fake.url)
    path.write_text(path.read_text().replace(TOKEN, "wrong"))
    with (
        client.connect(str(path)) as c,
        pytest.raises(UserError, match=r"rejected .* \(401 Unauthorized\) to get rayjob"),
    ):
        client.status(NAME, NS, c)


def test_kubeconfig_missing_names_the_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    missing = tmp_path / "nope" / "config"
    with pytest.raises(UserError, match=f"kubeconfig {missing} does not exist"):
        client.connect(str(missing))
    monkeypatch.setenv("KUBECONFIG", str(missing))
    with pytest.raises(UserError, match=f"kubeconfig {missing} does not exist"):
        client.connect()
    (tmp_path / "bad").write_text("clusters: [\n")
    with pytest.raises(UserError, match=f"cannot load kubeconfig {tmp_path / 'bad'}"):
        client.connect(str(tmp_path / "bad"))


def test_context_argument(fake: FakeCluster, tmp_path: Path) -> None:
    path = _kubeconfig(tmp_path / "kubeconfig", "http://127.0.0.1:9")
    config = yaml.safe_load(path.read_text())
    config["clusters"].append({"name": "real", "cluster": {"server": fake.url}})
    config["contexts"].append({"name": "real", "context": {"cluster": "real", "user": "tester"}})
    path.write_text(yaml.safe_dump(config))
    with client.connect(str(path), context="real") as c:
        assert c.server == fake.url
        assert client.submit(rendered(), c)[-1] == f"rayjob/{NAME} created"
    with pytest.raises(UserError, match=f"cannot load kubeconfig {path}: .*nope"):
        client.connect(str(path), context="nope")


def test_server_down_names_the_url_fast(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    start = time.monotonic()
    c = client.connect(str(_kubeconfig(tmp_path / "kubeconfig", url)), timeout=2.0)
    with pytest.raises(UserError, match=rf"cannot reach the Kubernetes API server at {url} \(.*refused"):
        client.submit(rendered(), c)
    c.close()
    assert time.monotonic() - start < 5


def test_the_cli_submits_the_rendered_example_then_follows_and_deletes_it(
    fake: FakeCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from loopline.cli import main
    from loopline.config import load_config
    from loopline.k8s.render import render

    example = str(Path(__file__).resolve().parents[2] / "examples" / "k8s.yaml")
    kubeconfig = str(_kubeconfig(tmp_path / "kubeconfig", fake.url))
    assert main(["k8s", "submit", example, "seed=5", "--kubeconfig", kubeconfig]) == 0
    out = capsys.readouterr().out
    assert "rayjob/loopline-code-k8s created" in out
    assert "loopline k8s status loopline-code-k8s -n rl-team" in out
    sent = [body for method, _, body in fake.requests if method == "POST"]
    assert sent == render(load_config(example, ["seed=5"]))  # exactly what render gives (and checks)
    assert main(["k8s", "status", "loopline-code-k8s", "-n", "rl-team", "--kubeconfig", kubeconfig]) == 0
    assert "loopline-code-k8s: Suspended" in capsys.readouterr().out
    assert main(["k8s", "delete", "loopline-code-k8s", "-n", "rl-team", "--kubeconfig", kubeconfig]) == 0
    assert "rayjob/loopline-code-k8s deleted" in capsys.readouterr().out
    # a config that cannot be rendered fails before the cluster is contacted
    seen = len(fake.requests)
    assert (
        main(["k8s", "submit", example, "k8s.groups.trainer.bundles_per_pod=3", "--kubeconfig", kubeconfig])
        == 2
    )
    assert "does not divide" in capsys.readouterr().err and len(fake.requests) == seen
