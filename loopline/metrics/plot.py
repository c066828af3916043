"""`loopline plot RUN_DIR`: reward and accuracy curves as PNG files in the run directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loopline.metrics.logger import read_metrics


def plot_run(run_dir: str | Path) -> list[Path]:
    """Write curves.png (reward, held-out accuracy, loss, response length; an MoE policy's router balance too);
    return the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    sft = [r for r in rows if r.get("phase") == "sft" and "loss" in r]
    rl = [r for r in rows if r.get("phase") == "grpo" and "reward_mean" in r]
    evals = [r for r in rows if "eval_accuracy" in r]
    routed = [r for r in rows if "router_cv" in r]
    fig, axes = plt.subplots(3 if routed else 2, 2, figsize=(11, 10.5 if routed else 7), squeeze=False)
    ax = axes[0][0]
    ax.plot([r["step"] for r in rl], [r["reward_mean"] for r in rl], label="train reward (mean)")
    ax.set_title("GRPO reward")
    ax.set_xlabel("RL step")
    ax.legend()
    ax = axes[0][1]
    n_sft = max((r["step"] for r in sft), default=0)
    xs = [r["step"] + (n_sft if r.get("phase") == "grpo" else 0) for r in evals]
    ax.plot(xs, [r["eval_accuracy"] for r in evals], marker="o", label="held-out accuracy (greedy)")
    if n_sft:
        ax.axvline(n_sft, color="grey", linestyle="--", label="SFT -> GRPO")
    ax.set_title("Held-out accuracy")
    ax.set_xlabel("step (SFT steps, then RL steps)")
    ax.set_ylim(0, 1)
    ax.legend()
    ax = axes[1][0]
    ax.plot([r["step"] for r in sft], [r["loss"] for r in sft], label="SFT loss")
    ax.set_yscale("log")
    ax.set_title("SFT loss")
    ax.set_xlabel("SFT step")
    ax = axes[1][1]
    ax.plot([r["step"] for r in rl], [r.get("response_len_mean", 0) for r in rl], label="response length")
    ax.plot([r["step"] for r in rl], [r.get("entropy", 0) for r in rl], label="entropy")
    ax.set_title("GRPO responses")
    ax.set_xlabel("RL step")
    ax.legend()
    if routed:
        _router_panels(axes[2], routed)
    fig.tight_layout()
    out = Path(run_dir) / "curves.png"
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return [out]


def _router_panels(axes: Any, rows: list[dict[str, Any]]) -> None:
    """An MoE policy's routers over its training steps (every phase, one after the other): each layer's and the
    mean coefficient of variation of tokens per expert, and the load-balancing loss."""
    xs = list(range(1, len(rows) + 1))
    prefix = "router_cv_layer"
    layers = sorted({k for r in rows for k in r if k.startswith(prefix)}, key=lambda k: int(k[len(prefix) :]))
    ax = axes[0]
    for key in layers:
        ax.plot(xs, [r.get(key, float("nan")) for r in rows], linewidth=0.6, alpha=0.5)
    ax.plot(xs, [r["router_cv"] for r in rows], color="black", label="mean over layers")
    ax.set_title("Router balance: CV of tokens per expert (per layer)")
    ax.set_xlabel("training step (all phases)")
    ax.legend()
    ax = axes[1]
    ax.plot(xs, [r.get("router_aux_loss", float("nan")) for r in rows], label="pooled over layers")
    ax.set_title("Router load-balancing loss")
    ax.set_xlabel("training step (all phases)")
    ax.legend()
