"""The rooms of docs/architecture.md, checked: every import in loopline/ (module-level and function-local, `from x import y`
resolving y when it is a submodule) points down the layer table below or within its own layer, and no
modules import each other in a circle. Run alone: `pytest tests/test_layering.py` (no imports, just `ast`).

The table is the rooms as the code has them (docs/architecture.md#rooms summarises it; `algorithms` uses only
torch, `loops` uses everything). A module takes the layer of its longest matching prefix; higher layers
may import lower ones."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "loopline"

# (module prefix, layer, why there), bottom to top.
LAYERS: list[tuple[str, int, str]] = [
    ("loopline", 0, "the package itself: a version string"),
    ("loopline.errors", 0, "UserError: imports nothing"),
    ("loopline.version", 0, "the package version and the checkout's git commit"),
    ("loopline.section", 0, "the config base (Section, ConfigError, YAML + overrides): imports only errors"),
    ("loopline.algorithms", 1, "pure tensor functions: torch only"),
    ("loopline.metrics", 1, "logging and plots of metrics rows: files only"),
    ("loopline.runtime.cluster", 1, "start/join Ray: knows no model, only its Section"),
    ("loopline.runtime.placement", 1, "placement groups from pool configs: knows no model"),
    ("loopline.runtime.config", 1, "RuntimeConfig: ranks per role, cluster and placement sections"),
    ("loopline.k8s.config", 1, "K8sConfig: the k8s section (pydantic only), read by loopline.config"),
    ("loopline.envs.config", 1, "EnvConfig: the env section (names only), read by loopline.config"),
    ("loopline.envs.sandbox.config", 1, "SandboxConfig: the sandbox's section, part of the env section"),
    ("loopline.runtime.workers", 1, "WorkerGroup: N ranks of any class, local or Ray"),
    (
        "loopline.runtime.dispatch",
        1,
        "how a worker method's call splits over ranks and gathers: declared on the method",
    ),
    ("loopline.runtime.ray_actors", 1, "Ray actors: start, wait, failures, kill (workers, env pool)"),
    ("loopline.runtime.shard_layout", 1, "trainer and engine layouts, shard boxes: pure"),
    ("loopline.runtime.resharding", 1, "transfer plans between layouts: pure"),
    ("loopline.runtime.weight_sync", 1, "transport of a transfer plan: tensors and collectives"),
    ("loopline.data", 3, "datasets, sampler, batches: read config"),
    ("loopline.models", 3, "load a policy by config"),
    ("loopline.rollout", 4, "engines and trajectories over prompt rows and models"),
    ("loopline.training", 4, "trainers: algorithms' losses over data batches"),
    ("loopline.checkpoint", 5, "DCP state of trainers, run dirs of configs"),
    ("loopline.config", 5, "RunConfig: composes the sections beside their code below; run dirs read it"),
    ("loopline.config_rules", 5, "settings that other settings make meaningless: refused or warned at load"),
    (
        "loopline.plan",
        6,
        "memory and FLOPs of a run's ranks from its config (no torch); k8s and the CLI read it",
    ),
    ("loopline.k8s", 6, "a run's config as Kubernetes objects, their checks, the cluster client"),
    ("loopline.envs", 6, "environments over rollout; the env pool runs on runtime's Ray plumbing"),
    ("loopline.runtime", 7, "the roles (actor, engines, critic, reference, scorer) built from all below"),
    ("loopline.loops", 8, "the controllers: use every role"),
    ("loopline.commands", 9, "what each CLI command runs"),
    ("loopline.bench", 9, "benchmarks the CLI runs"),
    ("loopline.doctor", 9, "`loopline doctor`: versions, CPU, GPUs, sandbox, Ray"),
    ("loopline.preflight", 9, "a run command's checks before torch: config rules, files, out_dir, the plan"),
    ("loopline.cli", 10, "the `loopline` command"),
    ("loopline.api", 11, "the Python API: the CLI's commands as functions (after preflight's checks)"),
]

# Imports up the table that are meant; (importer, imported): reason. Keep short: fix instead where cheap.
ALLOWED_UP: dict[tuple[str, str], str] = {
    ("loopline", "loopline.api"): "`loopline.train(...)`: the API's names, imported on first use",
    ("loopline", "loopline.config"): "`loopline.config.GRPOConfig(...)`: the config sections, on first use",
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    # inside/: the sandbox's programs, shipped as files and run in the sandbox, never imported as modules
    return {
        _module_name(p): p
        for p in sorted(PACKAGE.rglob("*.py"))
        if "inside" not in p.relative_to(PACKAGE).parts
    }


def _type_only(tree: ast.AST) -> set[int]:
    """ids of the import nodes under `if TYPE_CHECKING:`: read by type checkers, never run."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            out.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return out


def _imports(name: str, path: Path, modules: dict[str, Path], run_only: bool = False) -> set[str]:
    """The loopline modules `name` imports anywhere in its file (functions and TYPE_CHECKING included;
    run_only: leaving out the TYPE_CHECKING ones, which never run)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    skip = _type_only(tree) if run_only else set()
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.add(sub if sub in modules else base)
    return {m for m in out if m in modules and m != name}


def _graph(run_only: bool = False) -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules, run_only) for name, path in modules.items()}


def _layer(module: str) -> tuple[str, int]:
    best = max(
        (p for p in LAYERS if module == p[0] or module.startswith(p[0] + ".")), key=lambda p: len(p[0])
    )
    return best[0], best[1]


def test_the_walker_sees_local_and_submodule_imports():
    graph = _graph()
    assert "loopline.commands" in graph["loopline.cli"]  # `from loopline import commands`, in a function
    assert "loopline.runtime.critic" in graph["loopline.runtime.roles"]  # function-local
    assert len(graph) > 50


def test_every_module_has_a_room():
    """A new top-level module or package is placed in LAYERS on purpose, not by falling back to `loopline`."""
    unplaced = [m for m in _modules() if m != "loopline" and _layer(m)[0] == "loopline"]
    assert not unplaced, f"add these to LAYERS: {unplaced}"


def test_no_import_runs_up_the_rooms():
    graph = _graph()
    up = []
    for importer, imported in sorted((a, b) for a, bs in graph.items() for b in bs):
        (room_a, layer_a), (room_b, layer_b) = _layer(importer), _layer(imported)
        if layer_b > layer_a and (importer, imported) not in ALLOWED_UP:
            up.append(
                f"{importer} ({room_a}, layer {layer_a}) imports {imported} ({room_b}, layer {layer_b})"
            )
    assert not up, "imports up the rooms (docs/architecture.md#rooms):\n" + "\n".join(up)
    stale = [pair for pair in ALLOWED_UP if pair[1] not in graph.get(pair[0], set())]
    assert not stale, f"ALLOWED_UP lists imports that are gone: {stale}"


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan): each is a circle of imports."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def test_the_circle_finder_finds_circles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"f"}, "f": {"e"}}
    assert sorted(_circles(graph)) == [["a", "b", "c"], ["e", "f"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles():
    """A circle of imports that run (a type-only import back, under TYPE_CHECKING, is not one)."""
    circles = _circles(_graph(run_only=True))
    assert not circles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in circles)


def test_section_base_is_a_leaf():
    """Config sections beside their code build on loopline.section, which imports nothing from loopline
    but errors.UserError (itself importing nothing), so that any room can define its section."""
    graph = _graph()
    assert graph["loopline.errors"] == set()
    assert graph["loopline.section"] <= {"loopline.errors"}
