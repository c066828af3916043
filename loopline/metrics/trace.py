"""A run's timeline: spans of the RL loop's stages (generate, score, experience, train, sync, eval) per lane
(the rollout side, the trainer side), written as Chrome trace JSON, which chrome://tracing and ui.perfetto.dev
open: a user sees where engines and trainer overlap and where each waits."""

from __future__ import annotations

import json
import os
import threading
import time
from collections import deque
from pathlib import Path

LANES = ("rollout", "trainer")  # one row each in the viewer
MAX_SPANS = 100_000  # the newest kept: about 10,000 RL steps, a trace file of some 15 MB


class Trace:
    """Spans recorded from any thread; `write` saves the newest MAX_SPANS (microseconds from the trace's start)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.events: deque[dict] = deque(maxlen=MAX_SPANS)
        self._lock = threading.Lock()

    def span(self, lane: str, name: str, start: float, end: float, **args: float) -> None:
        """A span of stage `name` on `lane` from perf_counter `start` to `end`."""
        event = {
            "name": name,
            "ph": "X",
            "ts": round((start - self.start) * 1e6),
            "dur": round((end - start) * 1e6),
            "pid": os.getpid(),
            "tid": LANES.index(lane) if lane in LANES else len(LANES),
            "args": args,
        }
        with self._lock:
            self.events.append(event)

    def write(self, path: str | Path) -> Path:
        """Save as Chrome trace JSON (whole file at once: a reader never sees half of it)."""
        path = Path(path)
        names = [
            {"name": "thread_name", "ph": "M", "pid": os.getpid(), "tid": i, "args": {"name": lane}}
            for i, lane in enumerate(LANES)
        ]
        with self._lock:
            doc = {"traceEvents": names + list(self.events), "displayTimeUnit": "ms"}
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc))
        tmp.replace(path)
        return path


def read_spans(path: str | Path) -> list[tuple[str, str, float, float]]:
    """(lane, name, start s, end s) of each span in a trace file."""
    events = json.loads(Path(path).read_text())["traceEvents"]
    lanes = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    return [
        (lanes.get(e["tid"], "other"), e["name"], e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6)
        for e in events
        if e["ph"] == "X"
    ]


def plot_timeline(traces: dict[str, str | Path], out: str | Path, seconds: float = 20.0) -> Path:
    """A picture of the first `seconds` of each trace (one panel per trace, one row per lane), saved as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {
        "rollout": "tab:blue", "score": "tab:cyan", "experience": "tab:orange", "train": "tab:red",
        "sync": "tab:green", "eval": "tab:purple", "checkpoint": "tab:gray", "wait": "lightgray",
    }  # fmt: skip
    fig, axes = plt.subplots(len(traces), 1, figsize=(11, 1.4 * len(traces) + 0.6), squeeze=False)
    for ax, (title, path) in zip(axes[:, 0], traces.items(), strict=True):
        spans = read_spans(path)
        t0 = min((s for _, _, s, _ in spans), default=0.0)
        for lane, name, start, end in spans:
            if start - t0 > seconds or lane not in LANES:
                continue
            row = LANES.index(lane)
            ax.broken_barh([(start - t0, end - start)], (row - 0.4, 0.8), color=colours.get(name, "black"))
        ax.set_yticks(range(len(LANES)), LANES)
        ax.set_xlim(0, seconds)
        ax.set_title(title, fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("seconds")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colours.values()]
    fig.legend(handles, list(colours), ncol=len(colours), loc="lower center", fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
