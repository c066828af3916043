"""`loopline k8s`: render a run as Kubernetes manifests, check them, submit them, follow and delete the job;
stage the run's local files (model, data, env file) onto its volume first."""

from __future__ import annotations

import argparse
import importlib
import shlex
import sys
from pathlib import Path
from typing import Any

from loopline.config import RunConfig, check_preference, load_config
from loopline.errors import UserError
from loopline.k8s.render import JOB_COMMANDS, manifest_yaml, manifests_yaml


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loopline k8s", description=__doc__, allow_abbrev=False)
    sub = parser.add_subparsers(dest="action", required=True)
    for action, what in (
        ("render", "write the run's manifests (checked) to --out DIR, or print them"),
        ("submit", "render, check and create the run's objects on the cluster"),
    ):
        p = sub.add_parser(action, help=what, allow_abbrev=False)
        p.add_argument("config", nargs="?", default=None, help="YAML config file (optional)")
        p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. k8s.namespace=ml")
        p.add_argument(
            "--command",
            choices=JOB_COMMANDS,
            default="train",
            help="what the job runs (each resumes when the job is retried): train (default), sft or dpo",
        )
        if action == "render":
            p.add_argument("--out", default=None, help="directory to write one YAML file per object into")
    p = sub.add_parser(
        "stage",
        help="copy the run's local files (model, data, env file) onto its volume: writes the config that points "
        "at the copies, a pod that mounts the volume and the kubectl script that copies into it",
        allow_abbrev=False,
    )
    p.add_argument("config", nargs="?", default=None, help="YAML config file (optional)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. model.path=mymodel")
    p.add_argument(
        "--out", required=True, help="directory to write run.yaml, stage-objects.yaml, stage.sh into"
    )
    for action, what in (
        ("status", "the job's state (queued, running, succeeded, failed)"),
        ("logs", "the logs of the run's driver"),
        ("delete", "delete the job and its config (the run volume only with --storage)"),
    ):
        p = sub.add_parser(action, help=what, allow_abbrev=False)
        p.add_argument("name", help="the RayJob's name (k8s.name, or loopline-<last part of out_dir>)")
        p.add_argument("-n", "--namespace", default="default", help="its namespace (k8s.namespace)")
        if action == "logs":
            p.add_argument("--tail", type=int, default=None, help="only the last N lines")
        if action == "delete":
            p.add_argument("--storage", action="store_true", help="also delete the run volume (checkpoints)")
    for p in sub.choices.values():
        if p.prog.split()[-1] not in ("render", "stage"):
            p.add_argument(
                "--kubeconfig", default=None, help="kubeconfig file (default: $KUBECONFIG, ~/.kube/config)"
            )
            p.add_argument("--context", default=None, help="kubeconfig context (default: its current one)")
    return parser


def _need(module: str) -> Any:
    """Import a module that needs the k8s extra, or say how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise UserError(
            f"loopline k8s needs the k8s extra ({e.name} is missing): scripts/setup k8s, or "
            "pip install 'loopline[k8s]'"
        ) from None


def _config_args(config: str | None, overrides: list[str]) -> tuple[str | None, list[str]]:
    if config is not None and "=" in config:  # `loopline k8s render k8s.queue=q`: no file
        return None, [config, *overrides]
    return config, overrides


def _stage_command(config: str | None, overrides: list[str], name: str) -> str:
    """The `loopline k8s stage` line for the same config and overrides (what render's refusal says to run)."""
    words = ["loopline", "k8s", "stage", *([config] if config else []), *overrides, "--out", f"{name}-stage"]
    return shlex.join(words)


def _rendered(config: str | None, overrides: list[str], command: str = "train") -> list[dict[str, Any]]:
    from loopline.k8s.render import job_name, render

    check = _need("loopline.k8s.checks").check

    config, overrides = _config_args(config, overrides)
    cfg = load_config(config, overrides)
    if command == "dpo":  # what `loopline dpo` refuses at once, refused before the job is made
        check_preference(cfg, command)
    _notes(cfg)
    objects = render(cfg, command, _stage_command(config, overrides, job_name(cfg)))
    check(objects)
    return objects


def _notes(cfg: RunConfig) -> None:
    """Say which absolute paths are left for the pods' image to hold (neither here nor on the volume)."""
    from loopline.k8s.staging import image_paths

    for note in image_paths(cfg):
        print(f"loopline: note: {note}", file=sys.stderr)


def _out_dir(out: str) -> Path:
    folder = Path(out)
    if folder.exists() and not folder.is_dir():
        raise UserError(f"--out: '{folder}' is a file, not a directory")
    return folder


def _stage(config: str | None, overrides: list[str], out: str) -> int:
    """`loopline k8s stage`: plan the copies, check that the staged config renders, then write the files."""
    from loopline.k8s.render import claim_name, claim_objects, job_name, render
    from loopline.k8s.staging import (
        STAGE_CONFIG,
        STAGE_SCRIPT,
        stage_plan,
        stage_pod,
        staged_config,
        write_stage,
    )

    check = _need("loopline.k8s.checks").check
    config, overrides = _config_args(config, overrides)
    cfg = load_config(config, overrides)
    folder = _out_dir(out)
    name = job_name(cfg)
    _notes(cfg)
    plan = stage_plan(cfg, name)
    if not plan:
        print(
            "nothing to stage: every file the run reads is already on its volume, or none is on this machine"
        )
        return 0
    check(render(staged_config(cfg, plan, name)))  # what the user renders next must render
    objects = [*claim_objects(cfg, name), stage_pod(cfg, name, claim_name(cfg.k8s, name))]
    write_stage(folder, cfg, plan, name, objects)
    for s in plan:
        print(f"{s.field.key}: {s.local} -> {s.volume}")
    print(
        f"run {folder / STAGE_SCRIPT} to copy them (kubectl), then: loopline k8s render {folder / STAGE_CONFIG}"
    )
    return 0


def _write(objects: list[dict[str, Any]], out: str | None) -> None:
    if out is None:
        sys.stdout.write(manifests_yaml(objects))
        return
    folder = _out_dir(out)
    folder.mkdir(parents=True, exist_ok=True)
    for i, obj in enumerate(objects):
        path = folder / f"{i:02d}-{obj['kind'].lower()}.yaml"
        path.write_text(manifest_yaml(obj))
        print(path)


def main(argv: list[str]) -> int:
    args, extra = _parser().parse_known_args(argv)
    if extra:  # key=value words after an option are overrides too
        if not hasattr(args, "overrides") or any(x.startswith("-") or "=" not in x for x in extra):
            _parser().error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    if args.action == "stage":
        return _stage(args.config, args.overrides, args.out)
    # render and check first: a config that cannot run fails before any cluster is contacted
    objects = (
        _rendered(args.config, args.overrides, args.command) if args.action in ("render", "submit") else []
    )
    if args.action == "render":
        _write(objects, args.out)
        return 0
    client = _need("loopline.k8s.client")
    with client.connect(args.kubeconfig, args.context) as cluster:
        if args.action == "submit":
            for line in client.submit(objects, cluster):
                print(line)
            job = objects[-1]["metadata"]
            print(f"follow it with: loopline k8s status {job['name']} -n {job['namespace']}")
        elif args.action == "status":
            print(client.format_status(client.status(args.name, args.namespace, cluster)))
        elif args.action == "logs":
            sys.stdout.write(client.logs(args.name, args.namespace, tail_lines=args.tail, cluster=cluster))
        elif args.action == "delete":
            for line in client.delete(args.name, args.namespace, storage=args.storage, cluster=cluster):
                print(line)
    return 0
