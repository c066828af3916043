"""`loopline plot RUN_DIR`: reward and accuracy curves as PNG files in the run directory."""

from __future__ import annotations

from pathlib import Path

from loopline.metrics.logger import read_metrics


def plot_run(run_dir: str | Path) -> list[Path]:
    """Write curves.png (reward, held-out accuracy, loss, response length); return the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    sft = [r for r in rows if r.get("phase") == "sft" and "loss" in r]
    rl = [r for r in rows if r.get("phase") == "grpo" and "reward_mean" in r]
    evals = [r for r in rows if "eval_accuracy" in r]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
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
    fig.tight_layout()
    out = Path(run_dir) / "curves.png"
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return [out]
