"""Shared fixtures: the byte tokenizer, a small built-in model, the session's one Ray, and strict skips.

Strict skips: with LOOPLINE_STRICT_SKIPS=1 (scripts/test sets it, so CI and `make test` do) a test that would
skip fails instead, naming what was missing (a dependency, a usable bubblewrap, a free Ray). Only skips whose
reason starts with GPU_ONLY or CLUSTER_ONLY stay skips: no machine here has a GPU or a Kubernetes cluster. Skip through `need()` /
`need_module()`; a plain `pytest.skip`/`skipif`/`importorskip` is caught by the report hooks below as well.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import pytest
import torch

from loopline.config import TinyModelConfig
from loopline.models.load import build_tiny_model
from loopline.models.tokenizer import build_byte_tokenizer

if TYPE_CHECKING:
    from ray.cluster_utils import Cluster

# Ray reads this once, on import: every Ray node of the tests listens on 127.0.0.1 only.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

# A suite started in the background of a non-interactive shell (`cmd &` in a script, as CI may) inherits SIGINT
# ignored (POSIX), and so would every `loopline` it starts: the SIGINT tests would wait for a signal that never
# arrives. A Python handler here is reset to the default in each child at exec, so they get SIGINT again.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# The models here are tiny: one thread is as fast as two, and does not fight the other test process
# on a 2-core machine (oversubscribed, the same tests run 5-10x slower).
torch.set_num_threads(1)

# Smaller than the default built-in model; same architecture (Qwen2 with GQA and tied embeddings).
SMALL = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64)


# ---------------------------------------------------------------------------------------------------------
# Strict skips
# ---------------------------------------------------------------------------------------------------------

STRICT_SKIPS = os.environ.get("LOOPLINE_STRICT_SKIPS", "") not in ("", "0")
GPU_ONLY = "GPU only:"  # the kinds of skip that strict mode lets through: no machine here has these
CLUSTER_ONLY = "Cluster only:"  # a real Kubernetes cluster ($KUBECONFIG)
ALLOWED_SKIPS = (GPU_ONLY, CLUSTER_ONLY)


def need(ok: object, reason: str) -> None:
    """Skip the calling test unless `ok` (under LOOPLINE_STRICT_SKIPS=1: fail it, naming the reason)."""
    if ok:
        return
    if STRICT_SKIPS and not reason.startswith(ALLOWED_SKIPS):
        pytest.fail(f"{reason} (LOOPLINE_STRICT_SKIPS=1: this test must run here)", pytrace=False)
    pytest.skip(reason)


def needs(ok: object, reason: str) -> pytest.MarkDecorator:
    """`need` as a mark, for parametrised cases and whole tests: skips, or fails under strict mode."""
    return pytest.mark.skipif(not ok, reason=reason)  # the report hooks below make it fail when strict


def need_module(name: str, reason: str = "") -> ModuleType:
    """`pytest.importorskip` that fails under LOOPLINE_STRICT_SKIPS=1; also usable at module level."""
    try:
        return __import__(name, fromlist=["_"])
    except ImportError as e:
        why = reason or f"{name} is not installed"
        if STRICT_SKIPS:
            pytest.fail(f"{why}: {e} (LOOPLINE_STRICT_SKIPS=1: this test must run here)", pytrace=False)
        pytest.skip(why, allow_module_level=True)
        raise  # unreachable: skip raises


def _strict_failure(report: pytest.CollectReport | pytest.TestReport) -> None:
    """Turn a skip report into a failure under strict mode, unless it is GPU-only."""
    if not (STRICT_SKIPS and report.skipped) or getattr(report, "wasxfail", None) is not None:
        return
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    if reason.removeprefix("Skipped: ").startswith(ALLOWED_SKIPS):
        return
    report.outcome = "failed"
    report.longrepr = f"skipped under LOOPLINE_STRICT_SKIPS=1: {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    _strict_failure(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    outcome = yield
    _strict_failure(outcome.get_result())


# ---------------------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def tokenizer():
    return build_byte_tokenizer()


@pytest.fixture(scope="session")
def small_cfg() -> TinyModelConfig:
    return SMALL


@pytest.fixture
def small_model(tokenizer):
    """A fresh, randomly initialised small model (seed 0) per test."""
    return build_tiny_model(SMALL, tokenizer, seed=0)


# ---------------------------------------------------------------------------------------------------------
# Ray: one cluster for the whole session
# ---------------------------------------------------------------------------------------------------------

# Logical CPUs of the session's Ray: the most any module places at once (2 trainer ranks, 1 engine and 2 env
# workers; or 1 trainer rank, 3 engines and 1 env worker). Logical: the ranks share the machine's cores.
RAY_CPUS = 5
RAY_NAMESPACE = "loopline"  # the namespace loopline's own runs use (ClusterConfig.namespace)


@pytest.fixture(scope="session")
def ray_session() -> Iterator[Cluster]:
    """The session's one Ray: a head node on 127.0.0.1 with RAY_CPUS CPUs, files in a private temp dir.

    A ray.cluster_utils.Cluster, so that a module that needs a multi-node layout can add nodes to it
    (`add_ray_nodes`) and remove them again. Runs started in this process
    find Ray initialised and join it (loopline.distributed.cluster.start_ray); processes started by a test join it
    with runtime.cluster.address=<its address>.
    """
    ray = need_module("ray", "Ray is not installed (pip install loopline[ray])")
    from loopline.distributed.cluster import local_multinode_cluster

    need(not ray.is_initialized(), "Ray is already initialised in this process (a test leaked it)")
    with local_multinode_cluster([], head_cpus=RAY_CPUS, object_store_mb=300, namespace=RAY_NAMESPACE) as c:
        yield c


def _free_cpus() -> float:
    from loopline.distributed.placement import cluster_free_resources

    return sum(n.get("CPU", 0.0) for n in cluster_free_resources())


@pytest.fixture(scope="module")
def ray_cluster(ray_session: Cluster) -> Iterator[Cluster]:
    """The session's Ray for one module; afterwards every CPU must be free again (nothing leaked)."""
    import ray

    determinism = torch.are_deterministic_algorithms_enabled()  # runs in this process may switch it on
    yield ray_session
    torch.use_deterministic_algorithms(determinism)
    assert ray.is_initialized(), "a test disconnected from the session's Ray"
    deadline = time.monotonic() + 60  # actors and placement groups are released asynchronously
    while _free_cpus() < RAY_CPUS and time.monotonic() < deadline:
        time.sleep(0.2)
    left = _free_cpus()
    if left < RAY_CPUS:
        pytest.fail(
            f"Ray CPUs still held after the module: {RAY_CPUS - left} (a leaked actor or placement group)"
        )


@pytest.fixture(scope="module")
def add_ray_nodes(ray_cluster: Cluster) -> Iterator[Callable[[Sequence[Mapping[str, float]]], list[str]]]:
    """For a module that needs a multi-node layout: add nodes to the session's Ray, removed after the module.

    `add_ray_nodes([{"CPU": 1, "trainer": 2}, ...])` starts one node per entry on 127.0.0.1 with those
    resources (pools that ask for a custom resource land there, not on the head) and returns their node ids.
    """
    from loopline.distributed.cluster import _loopback

    added = []

    def add(nodes: Sequence[Mapping[str, float]]) -> list[str]:
        new = []
        with _loopback():
            for res in nodes:
                custom = {k: v for k, v in res.items() if k not in ("CPU", "GPU")}
                node = ray_cluster.add_node(
                    num_cpus=int(res.get("CPU", 0)),
                    num_gpus=int(res.get("GPU", 0)),
                    resources=custom,
                    object_store_memory=100 * 2**20,
                    node_ip_address="127.0.0.1",
                )
                added.append(node)
                new.append(node)
            ray_cluster.wait_for_nodes()
        return [node.node_id for node in new]

    yield add
    for node in reversed(added):
        ray_cluster.remove_node(node)


# ---------------------------------------------------------------------------------------------------------
# Layers: one mark per test (registered in pyproject.toml), so that `pytest -m ray` etc. runs one layer alone
# ---------------------------------------------------------------------------------------------------------

LAYER_MARKS = ("unit", "gloo", "ray", "sandbox", "e2e", "cluster")
# A test that uses the session's Ray is `ray`; otherwise its module's layer here; otherwise `unit`. A module of
# unit tests with a few heavier ones marks those itself (@pytest.mark.gloo etc.): `make test-fast` runs `-m unit`.
RAY_FIXTURES = {"ray_session", "ray_cluster", "add_ray_nodes"}
MODULE_LAYERS = {
    **dict.fromkeys(
        [
            "tests/checkpoint/test_dcp.py",
            "tests/runtime/test_critic.py",
            "tests/runtime/test_reference.py",
            "tests/distributed/test_weight_sync.py",
            "tests/training/test_critic_fsdp.py",
            "tests/training/test_fsdp_equivalence.py",
            "tests/training/test_tp.py",
        ],
        "gloo",
    ),
    **dict.fromkeys(
        [
            "tests/envs/test_pool.py",
            "tests/runtime/test_elastic_engines.py",
            "tests/runtime/test_fault_ray.py",
            "tests/distributed/test_placement.py",
            "tests/runtime/test_scorer.py",
            "tests/runtime/test_train_ray.py",
            "tests/runtime/test_train_ray_tp.py",
            "tests/distributed/test_workers.py",
        ],
        "ray",
    ),
    **dict.fromkeys(
        [
            "tests/envs/test_bench_env.py",
            "tests/envs/test_bench_sandbox.py",
            "tests/envs/test_cli.py",
            "tests/envs/test_code.py",
            "tests/envs/test_sandbox.py",
            "tests/envs/test_sandbox_inside.py",
        ],
        "sandbox",
    ),
    **dict.fromkeys(
        [
            "tests/checkpoint/test_bench_restart.py",
            "tests/checkpoint/test_faults.py",
            "tests/envs/test_agent_e2e.py",
            "tests/k8s/test_entrypoint.py",
            "tests/loops/test_dpo_rm.py",
            "tests/loops/test_env_in_loop.py",
            "tests/loops/test_grpo_variants.py",
            "tests/loops/test_multi_turn_loop.py",
            "tests/loops/test_openai_agent.py",
            "tests/loops/test_resume_exact.py",
            "tests/loops/test_resume_rl_state.py",
            "tests/loops/test_sft_stop.py",
            "tests/loops/test_train_e2e.py",
            "tests/runtime/test_bench_sync.py",
            "tests/runtime/test_fault_watchdog.py",
            "tests/test_cli.py",
            "tests/test_cli_hostile.py",
            "tests/test_resume_safety.py",
            "tests/training/test_lora.py",
        ],
        "e2e",
    ),
}


# The order in which scripts/test's two xdist workers are handed modules (--dist loadfile --no-loadscope-reorder: a
# module whole on one worker, so that its module fixtures are made once, in the order below): the layers whose
# modules take longest first, so that none of the long ones starts last. Within a layer, pytest-randomly's order.
LAYER_ORDER = ("ray", "e2e", "gloo", "sandbox", "cluster", "unit")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by mark
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    first: dict[Path, int] = {}  # module -> the heaviest layer among its tests
    for item in items:
        module = item.path.relative_to(config.rootpath).as_posix()
        named = next((m for m in LAYER_MARKS if item.get_closest_marker(m)), None)  # a module or test's own
        if named is None:
            ray = RAY_FIXTURES & set(getattr(item, "fixturenames", ()))
            named = "ray" if ray else MODULE_LAYERS.get(module, "unit")
            item.add_marker(getattr(pytest.mark, named))
        first[item.path] = min(first.get(item.path, len(LAYER_ORDER)), LAYER_ORDER.index(named))
    # a stable sort: pytest-randomly's order (it shuffles before this hook) stays within each layer and module
    items.sort(key=lambda item: first[item.path])
