"""The RL loop's timeline: spans written as Chrome trace JSON, read back, and drawn."""

from __future__ import annotations

import json
import time
from pathlib import Path

from loopline.metrics.trace import Trace, plot_timeline, read_spans


def test_spans_round_trip_through_chrome_trace_json(tmp_path: Path) -> None:
    trace = Trace()
    t0 = trace.start
    trace.span("rollout", "rollout", t0 + 0.5, t0 + 1.5)
    trace.span("trainer", "train", t0 + 1.0, t0 + 2.25, step=1)
    path = trace.write(tmp_path / "trace.json")
    doc = json.loads(path.read_text())
    # the viewer's fields: complete events in microseconds, lanes named by metadata events
    names = {e["tid"]: e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M"}
    assert names == {0: "rollout", 1: "trainer"}
    train = next(e for e in doc["traceEvents"] if e["name"] == "train")
    assert (train["ph"], train["ts"], train["dur"], train["args"]) == ("X", 1_000_000, 1_250_000, {"step": 1})
    assert read_spans(path) == [("rollout", "rollout", 0.5, 1.5), ("trainer", "train", 1.0, 2.25)]
    assert not (tmp_path / "trace.tmp").exists()


def test_the_timeline_is_drawn_for_each_trace(tmp_path: Path) -> None:
    paths = {}
    for name in ("sync", "async"):
        trace = Trace()
        now = time.perf_counter()
        trace.span("rollout", "rollout", now, now + 0.2)
        trace.span("trainer", "train", now + (0.2 if name == "sync" else 0.0), now + 0.5)
        paths[name] = trace.write(tmp_path / f"{name}.json")
    out = plot_timeline(paths, tmp_path / "timeline.png", seconds=1.0)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000
