"""The layering of docs/architecture.md#rooms: the rollout layer (engines, the chat-completions server, trajectories, tool-call
parsing) imports nothing from envs, which sits above it."""

from __future__ import annotations

import subprocess
import sys


def test_rollout_imports_nothing_from_envs():
    code = (
        "import sys, loopline.rollout.engine, loopline.rollout.openai_server, loopline.rollout.tool_calls, "
        "loopline.rollout.trajectory; print(sorted(m for m in sys.modules if m.startswith('loopline.envs')))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
