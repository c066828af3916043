"""Checks of rendered manifests before anything is submitted: the RayJob against KubeRay's CRD schema (unknown
fields rejected), KubeRay's and Kueue's admission rules (loopline.k8s.rules), core objects against Kubernetes'
own schemas (kubernetes-validate). What the API server would refuse is refused here, naming the field.
"""

from __future__ import annotations

import copy
import functools
import gzip
import json
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate

from loopline.errors import UserError
from loopline.k8s.rules import kuberay_problems, kueue_problems

CRD_SCHEMA = Path(__file__).parent / "crds" / "rayjob.v1.json.gz"


def _strict(schema: Any) -> Any:
    """The CRD schema as JSON Schema that rejects unknown fields: the API server prunes them silently, which
    hides a misspelt field; here every object with listed properties allows no others."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) if k in ("items", "additionalProperties", "anyOf", "allOf", "oneOf") else v
           for k, v in schema.items()}  # fmt: skip
    if "properties" in schema:
        out["properties"] = {k: _strict(v) for k, v in schema["properties"].items()}
        if "additionalProperties" not in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    if schema.get("nullable") and isinstance(schema.get("type"), str):
        out["type"] = [schema["type"], "null"]
    return out


@functools.cache
def _rayjob_validator() -> Any:
    schema = _strict(json.loads(gzip.decompress(CRD_SCHEMA.read_bytes())))
    return jsonschema.Draft7Validator(schema)


def _path(parts: Any) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "<root>"


def schema_problems(obj: dict[str, Any]) -> list[str]:
    """Where `obj` breaks its schema: the RayJob CRD for a RayJob, Kubernetes' own for core kinds."""
    kind = obj.get("kind")
    if kind == "RayJob":
        errors = sorted(_rayjob_validator().iter_errors(obj), key=lambda e: list(e.absolute_path))
        problems = [f"{_path(e.absolute_path)}: {e.message}" for e in errors]
        meta = obj.get("metadata", {})
        if not isinstance(meta.get("name"), str) or not meta["name"]:
            problems.append("metadata.name: a RayJob needs a name")
        return problems
    try:
        kubernetes_validate.validate(copy.deepcopy(obj), kubernetes_validate.latest_version(), strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"{_path(e.path)}: {e.message}"]
    except kubernetes_validate.SchemaNotFoundError:
        return [f"kind: no Kubernetes schema for {obj.get('apiVersion')}/{kind}"]
    return []


def problems(objects: list[dict[str, Any]]) -> list[str]:
    """Every problem of every object, each line prefixed with the object's kind/name."""
    out: list[str] = []
    for obj in objects:
        found = schema_problems(obj)
        if obj.get("kind") == "RayJob":
            found += kuberay_problems(obj) + kueue_problems(obj)
        who = f"{str(obj.get('kind', '?')).lower()}/{obj.get('metadata', {}).get('name', '?')}"
        out += [f"{who}: {p}" for p in found]
    return out


def check(objects: list[dict[str, Any]]) -> None:
    """Raise UserError listing every problem of the rendered objects (none: they may be submitted)."""
    found = problems(objects)
    if found:
        raise UserError(
            "the rendered manifests would be refused by the cluster:\n  - " + "\n  - ".join(found)
        )
