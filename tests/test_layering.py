"""The rooms of docs/architecture.md (#rooms), checked: every import in loopline/ (module-level, function-local and
under TYPE_CHECKING; `from x import y` resolving y when it is a submodule) points down the layer table below or
within its own layer, no modules import each other in a circle, each folder is one room of one layer, and the
files and functions stay short. Run alone: `pytest tests/test_layering.py` (no imports, just `ast`).

The table names folders and top-level modules, never a module inside a folder: a folder is one room. One kind of
module stands apart from its folder's layer: a folder's `config.py` is its config section, a pydantic leaf at
layer 1 that `loopline.config` composes into RunConfig (SECTION_LAYER)."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "loopline"

# (folder or top-level module, layer, why there), bottom to top.
LAYERS: list[tuple[str, int, str]] = [
    ("loopline", 0, "the package itself: a version string"),
    ("loopline.errors", 0, "UserError: imports nothing"),
    ("loopline.version", 0, "the package version and the checkout's git commit"),
    ("loopline.section", 0, "the config base (Section, ConfigError, YAML + overrides): imports only errors"),
    ("loopline.algorithms", 1, "pure tensor functions: torch only"),
    ("loopline.metrics", 1, "logging and plots of metrics rows: files only"),
    (
        "loopline.distributed",
        1,
        "the plumbing that knows no model: Ray cluster, placement, worker groups and dispatch, weight transfers",
    ),
    ("loopline.data", 3, "datasets, sampler, batches: read config"),
    ("loopline.models", 3, "load a policy by config"),
    ("loopline.rollout", 4, "engines and trajectories over prompt rows and models"),
    ("loopline.training", 4, "trainers: algorithms' losses over data batches"),
    ("loopline.checkpoint", 5, "DCP state of trainers, run dirs of configs"),
    ("loopline.config", 5, "RunConfig: composes the sections beside their code; run dirs read it"),
    ("loopline.config_rules", 5, "settings that other settings make meaningless: refused or warned at load"),
    (
        "loopline.plan",
        6,
        "memory and FLOPs of a run's ranks from its config (no torch); k8s and the CLI read it",
    ),
    (
        "loopline.plan_auto",
        6,
        "the auto settings (memory switches, bf16) resolved from the plan before a run",
    ),
    (
        "loopline.envs",
        6,
        "environments over rollout, registered in envs/specs.py; the env pool on Ray actors",
    ),
    ("loopline.runtime", 7, "the roles (actor, engines, critic, reference, scorer) built from all below"),
    ("loopline.loops", 8, "the controllers: use every role"),
    ("loopline.commands", 9, "what each CLI command runs"),
    ("loopline.doctor", 9, "`loopline doctor`: versions, CPU, GPUs, sandbox, Ray"),
    ("loopline.preflight", 9, "a run command's checks before torch: config rules, files, out_dir, the plan"),
    # outside the core: nothing below the CLI imports these two (their config section apart, see SECTION_LAYER)
    ("loopline.k8s", 10, "a run's config as Kubernetes objects, their checks, the cluster client"),
    ("loopline.bench", 10, "benchmarks the CLI runs"),
    ("loopline.cli", 11, "the `loopline` command"),
    ("loopline.api", 12, "the Python API: the CLI's commands as functions (after preflight's checks)"),
]

# A folder's config.py is its config section: pydantic on loopline.section, composed by loopline.config.
SECTION_LAYER = 1

# Imports up the table that are meant; (importer, imported): reason. Keep short: fix instead where cheap.
ALLOWED_UP: dict[tuple[str, str], str] = {
    ("loopline", "loopline.api"): "`loopline.train(...)`: the API's names, imported on first use",
    ("loopline", "loopline.config"): "`loopline.config.GRPOConfig(...)`: the config sections, on first use",
    (
        "loopline.models.config",
        "loopline.models.presets",
    ): "the section names presets: a table, imports nothing",
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


@functools.cache
def _graph(run_only: bool = False) -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules, run_only) for name, path in modules.items()}


def _room(module: str) -> tuple[str, int]:
    """The table's entry for `module`: its folder (or itself, a top-level module) and that layer."""
    best = max(
        (p for p in LAYERS if module == p[0] or module.startswith(p[0] + ".")), key=lambda p: len(p[0])
    )
    return best[0], best[1]


def _is_section(module: str) -> bool:
    return module.endswith(".config") and module != "loopline.config"


def _layer(module: str) -> tuple[str, int]:
    """(room, layer) of `module`: its folder's, but a section's own."""
    room, layer = _room(module)
    if _is_section(module):
        return f"{module} (a section)", SECTION_LAYER
    return room, layer


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
    """No circle of imports, counting those under TYPE_CHECKING: a type-only import back still ties two modules
    into one that must be read (and changed) together."""
    circles = _circles(_graph())
    assert not circles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in circles)


def test_section_base_is_a_leaf():
    """Config sections beside their code build on loopline.section, which imports nothing from loopline
    but errors.UserError (itself importing nothing), so that any room can define its section."""
    graph = _graph()
    assert graph["loopline.errors"] == set()
    assert graph["loopline.section"] <= {"loopline.errors"}


def _folders() -> list[str]:
    """Every package folder under loopline/ as a module name (the sandbox's inside/ programs apart)."""
    return sorted(
        _module_name(d / "x.py").rpartition(".")[0]
        for d in PACKAGE.rglob("*")
        if d.is_dir() and any(d.glob("*.py")) and "inside" not in d.relative_to(PACKAGE).parts
    )


def test_each_folder_is_one_room():
    """The table names folders and top-level modules only, so a folder's modules share its layer (sections
    apart); a module placed by name inside a folder would hide a second layer in it."""
    folders = set(_folders())
    inside = [p for p, _, _ in LAYERS if p.rpartition(".")[0] in folders and p not in folders]
    assert not inside, f"LAYERS names modules inside folders (place the folder, or move the module): {inside}"
    assert _layer("loopline.envs.sandbox.runner")[1] == _layer("loopline.envs.pool")[1]


# What a section may import besides loopline.section, loopline.errors and other sections: (section, module): why.
SECTION_IMPORTS: dict[tuple[str, str], str] = {
    ("loopline.models.config", "loopline.models.presets"): "the preset table (names and sizes): data only",
    (
        "loopline.runtime.config",
        "loopline.distributed.cluster",
    ): "ClusterConfig beside start_ray (the plumbing, layer 1)",
    (
        "loopline.runtime.config",
        "loopline.distributed.placement",
    ): "PlacementConfig beside its code (the plumbing, layer 1)",
}


def test_sections_are_leaves():
    """A section imports only the config base and other sections, so that loopline.config can compose every
    room's section without importing the room (k8s/ and envs/ sit above it)."""
    graph = _graph()
    wide = [
        f"{m} imports {i}"
        for m in sorted(graph)
        if _is_section(m)
        for i in sorted(graph[m])
        if i not in {"loopline.section", "loopline.errors"}
        and not _is_section(i)
        and (m, i) not in SECTION_IMPORTS
    ]
    assert not wide, "sections that import more than sections:\n" + "\n".join(wide)


def test_k8s_and_bench_are_outside_the_core():
    """Only the CLI and the API reach k8s/ and bench/ (and loopline.config the k8s section): a run never imports
    the Kubernetes client or a benchmark."""
    outside = ("loopline.k8s", "loopline.bench", "loopline.cli", "loopline.api")
    graph = _graph()
    reach = [
        f"{a} imports {b}"
        for a, bs in sorted(graph.items())
        if not a.startswith(outside)
        for b in sorted(bs)
        if b.startswith(("loopline.k8s", "loopline.bench")) and not _is_section(b)
    ]
    assert not reach, "the core imports k8s/ or bench/:\n" + "\n".join(reach)


# ---------------------------------------------------------------------------------------------------------
# Sizes: files one can read end to end, functions that fit a screen (docs/architecture.md#rooms)
# ---------------------------------------------------------------------------------------------------------

MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80

# Argument parsers: one add_argument per option reads best as one long flat function.
ARGUMENT_PARSERS = {"loopline/cli.py:build_parser"}

# Still over, each shrinking in a change of its own; remove an entry when it fits. A new entry needs a reason.
OVER_ALLOWED: dict[str, str] = {}


@functools.cache
def _sizes() -> dict[str, int]:
    """Lines of every file under loopline/ ("path") and of every function in it ("path:name")."""
    out: dict[str, int] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        text = path.read_text()
        out[rel] = text.count("\n")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                assert node.end_lineno is not None
                out[f"{rel}:{node.name}"] = node.end_lineno - node.lineno + 1
    return out


def _over(sizes: dict[str, int]) -> dict[str, int]:
    return {
        k: n
        for k, n in sizes.items()
        if n > (MAX_FUNCTION_LINES if ":" in k else MAX_FILE_LINES) and k not in ARGUMENT_PARSERS
    }


def test_the_size_walker_counts_files_and_functions():
    sizes = _sizes()
    assert sizes["loopline/errors.py"] < 40 and "loopline/cli.py:build_parser" in sizes
    assert _over({"a.py": 601, "b.py": 600, "a.py:f": 81, "a.py:g": 80}) == {"a.py": 601, "a.py:f": 81}


def test_no_file_or_function_too_long():
    """No file over 600 lines, no function over 80 (argument parsers apart) beyond OVER_ALLOWED, which only
    shrinks: an entry that now fits must go."""
    over = _over(_sizes())
    new = [f"{k}: {n} lines" for k, n in over.items() if k not in OVER_ALLOWED]
    assert not new, "over the size limits (split along a seam):\n" + "\n".join(new)
    fits = [k for k in OVER_ALLOWED if k not in over]
    assert not fits, f"OVER_ALLOWED lists what now fits; remove it: {fits}"


# ---------------------------------------------------------------------------------------------------------
# Envs plug in through envs/ alone (docs/architecture.md#where-to-look)
# ---------------------------------------------------------------------------------------------------------

# Env names written outside envs/ on purpose: "path:line-free name" -> why.
ENV_NAMES_OUTSIDE: dict[str, str] = {
    "loopline/runtime/scorer.py:addition": "the Scorer's default env, the same as the env section's default",
    "loopline/bench/env.py:code": "`loopline bench env` times these two built-in envs by name",
    "loopline/bench/env.py:calculator": "`loopline bench env` times these two built-in envs by name",
}


def _env_names() -> set[str]:
    """The keys of ENVS in envs/config.py, read with ast (no import)."""
    tree = ast.parse((PACKAGE / "envs" / "config.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.AnnAssign) and ast.unparse(node.target) == "ENVS":
            assert isinstance(node.value, ast.Dict)
            return {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
    raise AssertionError("no ENVS table in loopline/envs/config.py")


def test_no_env_is_named_outside_envs():
    """A built-in env is a spec in envs/config.py and code in envs/: no string outside envs/ names one (a dict's
    keys apart: {"code": ...} in an OpenAI error object is no env), so a new env needs no edit elsewhere."""
    names = _env_names()
    assert {"addition", "code", "calculator"} <= names
    found = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("loopline/envs/"):
            continue
        tree = ast.parse(path.read_text())
        keys = {
            id(k) for node in ast.walk(tree) if isinstance(node, ast.Dict) for k in node.keys if k is not None
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in names and id(node) not in keys:
                found.add(f"{rel}:{node.value}")
    extra = sorted(found - set(ENV_NAMES_OUTSIDE))
    assert not extra, "env names outside envs/ (give the env's spec a field instead):\n" + "\n".join(extra)
    assert not set(ENV_NAMES_OUTSIDE) - found, "ENV_NAMES_OUTSIDE lists names that are gone"
