"""training.memory=auto and training.mixed_precision=auto (loopline.plan_auto): the default job resolves to exactly
its old settings; a 0.5B preset shape under a small memory budget gets the switches, with ample memory none; a field
the config set (file, override, a resumed run's base), whatever its value, is never changed; the bf16 rule follows
the probe; `loopline plan` prints the one line. The probe itself is measured once, into a temporary cache."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from loopline import plan
from loopline.config import RunConfig, load_config
from loopline.plan_auto import MARGIN, resolve
from loopline.section import given_keys
from loopline.training import bf16_probe

FAST, SLOW = {"speedup": 4.0}, {"speedup": 1.2}  # probe results: bf16 4x faster / barely faster than float32
PRESET = ["model.preset=qwen2.5-0.5b", "model.init=random"]
# long completions: the activations and logits dominate the plan (~86 GiB without switches, fp32)
LONG = [*PRESET, "grpo.sampling.max_new_tokens=256", "grpo.prompts_per_step=8"]
SWITCHES = (
    "model.logits_chunk_tokens",
    "training.activation_checkpointing",
    "grpo.max_tokens_per_micro_batch",
)


def _value(cfg: RunConfig, key: str):
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def _planned(cfg: RunConfig, command: str = "train") -> int:
    return max(node.nbytes for node in plan.nodes(cfg, command))


@pytest.mark.parametrize("command", ["train", "sft", "dpo", "rm"])
def test_the_default_job_resolves_to_exactly_its_old_settings(command) -> None:
    before = load_config()
    resolved = resolve(
        before, command, probe=FAST
    )  # even where bf16 is fast: the built-in model stays float32
    old = before.model_dump()
    old["training"]["mixed_precision"] = "none"  # auto, resolved: what the field meant before it existed
    assert resolved.cfg.model_dump() == old
    assert resolved.cfg.compute_dtype == "float32" and resolved.cfg.engine_shares_weights
    assert (
        "no memory switch" in resolved.line
        and "training.mixed_precision=none (the built-in model" in resolved.line
    )


def test_a_small_budget_at_the_0_5b_shape_picks_the_switches_until_it_fits() -> None:
    cfg = load_config(None, [*LONG, "training.memory_budget_gib=18"])
    assert _planned(cfg) > 18 * 2**30  # does not fit without them
    resolved = resolve(cfg, "train", probe=SLOW)
    out = resolved.cfg
    assert out.model.logits_chunk_tokens == 512 and out.training.activation_checkpointing == "full"
    assert out.training.mixed_precision == "none"  # bf16 only 1.2x faster here
    assert _planned(out) <= MARGIN * 18 * 2**30
    assert resolved.line.count("\n") == 0 and resolved.line.startswith(
        "loopline: auto: training.memory=auto: "
    )
    assert "chose model.logits_chunk_tokens=512, training.activation_checkpointing=full" in resolved.line
    assert (
        "training.mixed_precision=none (bf16 matmuls 1.20x float32 on this CPU, under 1.5x)" in resolved.line
    )


def test_a_tighter_budget_adds_token_budget_micro_batches() -> None:
    # 1,024-token completions, 16 rows, a small held-out batch: the trainer's step is the peak
    longer = [*PRESET, "grpo.sampling.max_new_tokens=1024", "grpo.prompts_per_step=2", "eval.batch_size=2"]
    out = resolve(load_config(None, [*longer, "training.memory_budget_gib=12"]), "train", probe=SLOW).cfg
    grpo = plan.phases(out, "train", plan.model_shape(out))[-1]
    assert out.training.activation_checkpointing == "full" and out.model.logits_chunk_tokens == 512
    assert out.grpo.max_tokens_per_micro_batch == 8 * grpo.seq  # 16 rows a micro-batch halved once
    assert out.sft.max_tokens_per_micro_batch == 0  # SFT's short rows do not set the peak
    assert _planned(out) <= MARGIN * 12 * 2**30


def test_ample_memory_picks_nothing() -> None:
    cfg = load_config(None, [*LONG, "training.memory_budget_gib=512"])
    resolved = resolve(cfg, "train", probe=SLOW)
    for key in SWITCHES:
        assert _value(resolved.cfg, key) == _value(cfg, key)
    assert "within 80%: no memory switch" in resolved.line


def test_explicit_settings_win_whatever_their_value(tmp_path: Path) -> None:
    # a YAML file sets the checkpointing to its default value; an override sets the micro-batch
    path = tmp_path / "run.yaml"
    path.write_text("training:\n  activation_checkpointing: none\n")
    cfg = load_config(path, [*LONG, "training.memory_budget_gib=16", "grpo.micro_batch_size=64"])
    assert {"training.activation_checkpointing", "grpo.micro_batch_size"} <= given_keys(cfg)
    out = resolve(cfg, "train", probe=FAST).cfg
    assert out.training.activation_checkpointing == "none"  # set, so kept, although it would shrink the plan
    assert (
        out.grpo.micro_batch_size == 64 and out.grpo.max_tokens_per_micro_batch == 0
    )  # no budget replaces it
    assert out.model.logits_chunk_tokens == 512  # not set: auto's
    explicit = resolve(load_config(None, [*PRESET, "training.mixed_precision=none"]), "train", probe=FAST).cfg
    assert explicit.training.mixed_precision == "none"
    manual = resolve(load_config(None, [*LONG, "training.memory=manual"]), "train", probe=SLOW).cfg
    assert all(_value(manual, k) == _value(RunConfig(), k) for k in SWITCHES)


def test_a_resolved_or_resumed_config_resolves_to_itself() -> None:
    first = resolve(load_config(None, [*LONG, "training.memory_budget_gib=16"]), "train", probe=FAST).cfg
    assert resolve(first, "train", probe=SLOW).cfg.model_dump() == first.model_dump()
    # a resumed run: its saved config is the base, every field of it set
    saved = load_config(None, [*LONG, "training.activation_checkpointing=none"])
    resumed = load_config(None, ["grpo.steps=3"], base=saved)
    assert given_keys(resumed) == {"grpo.steps", "training.activation_checkpointing", *(
        f"{k.split('=')[0]}" for k in LONG)}  # fmt: skip
    assert resolve(resumed, "train", probe=SLOW).cfg.training.activation_checkpointing == "none"


def test_bf16_where_the_probe_finds_it_fast_and_the_run_allows_it() -> None:
    fast = resolve(load_config(None, PRESET), "train", probe=FAST)
    assert fast.cfg.training.mixed_precision == "bf16" and fast.cfg.engine_dtype == "bfloat16"
    assert "training.mixed_precision=bf16 (bf16 matmuls 4.00x float32" in fast.line
    for extra, why in (
        (["model.dtype=bfloat16"], "not built with model.dtype=bfloat16"),
        (["grpo.advantage=gae"], "not built with grpo.advantage=gae"),
    ):
        out = resolve(load_config(None, [*PRESET, *extra]), "train", probe=FAST)
        assert out.cfg.training.mixed_precision == "none" and why in out.line
    tiny = resolve(
        load_config(None, ["model.preset=qwen3-moe-tiny", "model.init=random"]), "train", probe=FAST
    )
    assert tiny.cfg.training.mixed_precision == "none" and "under 100M" in tiny.line
    # logprob_mismatch_kl is logged every step where engine and trainer dtypes differ (loops/grpo.py): bf16 here
    # keeps them equal, so the planned old-policy forward is the same as without the mismatch check
    assert fast.cfg.engine_dtype == fast.cfg.compute_dtype


def test_the_probe_measures_both_dtypes_and_caches_per_machine(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("LOOPLINE_CACHE_DIR", str(tmp_path))
    assert bf16_probe.cached() is None
    result = bf16_probe.probe()  # measured in a child process, which writes the cache
    assert result["float32_gflops"] > 0 and result["bfloat16_gflops"] > 0
    assert result["speedup"] == pytest.approx(result["bfloat16_gflops"] / result["float32_gflops"], rel=0.02)
    path = bf16_probe.cache_path()
    assert path.parent == tmp_path and json.loads(path.read_text()) == result == bf16_probe.cached()


def test_loopline_plan_prints_the_auto_line(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "loopline.cli", "plan", *LONG, "training.mixed_precision=none",
         "training.memory_budget_gib=16"],
        capture_output=True, text=True, timeout=120, cwd=Path(__file__).parent.parent,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "activation_checkpointing=full" in lines[0]
    assert lines[1].startswith("loopline: auto: training.memory=auto: the plan needs ")
    assert "chose model.logits_chunk_tokens=512, training.activation_checkpointing=full" in lines[1]


@pytest.mark.slow
def test_a_run_prints_the_line_and_saves_what_auto_chose(tmp_path: Path) -> None:
    run = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-m", "loopline.cli", "sft", "sft.steps=2", "sft.eval_every=0", f"out_dir={run}",
         "progress=false", "tensorboard=false"],
        capture_output=True, text=True, timeout=300, cwd=Path(__file__).parent.parent,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    said = [line for line in out.stdout.splitlines() if line.startswith("loopline: auto: ")]
    assert len(said) == 1 and "no memory switch" in said[0], out.stdout
    saved = load_config(run / "config.yaml")
    assert saved.training.mixed_precision == "none" and saved.training.activation_checkpointing == "none"
