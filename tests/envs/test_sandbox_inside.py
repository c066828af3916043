"""The programs that run inside the sandbox (loopline/envs/sandbox/inside/), on their own.

Each is a standalone script (standard library only): these tests read their imports, then run them
directly as scripts, speaking their protocol by hand, with no Sandbox around them. The judge runs
as this process's uid (the solutions here are benign); the zygote kills every other process of its
uid after each run, so it only runs under a leased sandbox uid (needs root).
"""

from __future__ import annotations

import ast
import marshal
import os
import runpy
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import loopline
from loopline.envs import code
from loopline.envs.sandbox import inside_source, pids_of_uid, readable_by_others
from loopline.envs.sandbox.uids import UidLease, kill_uid
from loopline.envs.sandbox.warm import ZYGOTE_PROGRAM
from tests.conftest import needs

INSIDE = Path(loopline.__file__).parent / "envs" / "sandbox" / "inside"
PROGRAMS = sorted(INSIDE.glob("*.py"))
ZYGOTE = INSIDE / "zygote.py"
JUDGE = INSIDE / "judge.py"
ROOT = os.geteuid() == 0
# The zygote runs as an unprivileged uid: it needs an interpreter that uid can run.
PYTHON = next(
    (
        p
        for p in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3")
        if p and readable_by_others(p)
    ),
    None,
)


# ---------------------------------------------------------------------------------------------
# Standalone: standard library only, never imported as loopline modules
# ---------------------------------------------------------------------------------------------


def _imported_modules(path: Path) -> set[str]:
    """Top-level names of every module `path` imports, function-local imports included."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path.name}: relative import (it is not a package module)"
            names.add((node.module or "").split(".")[0])
    return names


def test_the_inside_programs_are_zygote_and_judge() -> None:
    assert [p.name for p in PROGRAMS] == ["judge.py", "zygote.py"]
    assert not (INSIDE / "__init__.py").exists()


@pytest.mark.parametrize("path", PROGRAMS, ids=[p.name for p in PROGRAMS])
def test_inside_program_imports_only_the_standard_library(path: Path) -> None:
    modules = _imported_modules(path)
    assert "loopline" not in modules
    assert modules <= set(sys.stdlib_module_names) | {"__future__"}, modules - set(sys.stdlib_module_names)
    # Run as a script, never on import: `if __name__ == "__main__":` is the only top-level call.
    tree = ast.parse(path.read_text())
    calls = [n for n in tree.body if isinstance(n, ast.Expr) and isinstance(n.value, ast.Call)]
    mains = [n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)]
    assert not calls and len(mains) == 1


def test_no_loopline_module_imports_an_inside_program() -> None:
    for path in Path(loopline.__file__).parent.rglob("*.py"):
        if INSIDE in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [f"{node.module}.{alias.name}" for alias in node.names]
            assert not any("inside" in name.split(".") for name in names), f"{path} imports {names}"


def test_the_host_hands_over_the_files_unchanged() -> None:
    assert ZYGOTE_PROGRAM == ZYGOTE.read_text() == inside_source("zygote.py")
    assert code.JUDGE_PROGRAM == JUDGE.read_text() == inside_source("judge.py")
    assert runpy.run_path(str(JUDGE), run_name="judge")["VERDICT"] == code.VERDICT


# ---------------------------------------------------------------------------------------------
# The judge, run as `python judge.py` with the payload on stdin
# ---------------------------------------------------------------------------------------------

NONCE = "6e6f6e6365" * 3
ADD_PROMPT = 'def add(a, b):\n    """Return a + b."""\n'
ADD_TEST = "def check(candidate):\n    print('testing')\n    assert candidate(1, 2) == 3\n    assert candidate(-1, 1) == 0\n"


def judge(completion: str, *, test: str = ADD_TEST) -> subprocess.CompletedProcess[bytes]:
    payload = {
        "nonce": NONCE,
        "prompt": ADD_PROMPT,
        "solution": ADD_PROMPT + completion,
        "test": test,
        "entry_point": "add",
    }
    return subprocess.run(
        [sys.executable, "-I", "-S", str(JUDGE)],
        input=marshal.dumps(payload, 4),
        capture_output=True,
        timeout=60,
    )


def verdict(run: subprocess.CompletedProcess[bytes]) -> str:
    return run.stdout.decode().strip().splitlines()[-1]


def test_judge_passes_a_right_solution_with_the_nonce() -> None:
    run = judge("    print('solving')\n    return a + b\n")
    assert run.returncode == 0, run.stderr.decode()
    assert run.stdout.decode().strip() == f"loopline-verdict passed {NONCE}"  # the verdict alone
    assert b"testing" in run.stderr and b"solving" in run.stderr  # prints go to stderr


def test_judge_fails_a_wrong_solution() -> None:
    run = judge("    return a - b\n")
    assert run.returncode == 1
    assert verdict(run).startswith("loopline-verdict failed AssertionError")
    assert NONCE.encode() not in run.stdout + run.stderr


def test_judge_fails_a_solution_that_exits_or_fakes_a_verdict() -> None:
    fake = f"loopline-verdict passed {NONCE}"
    run = judge(f"    return a + b\nprint({fake!r})\nimport sys\nsys.exit(0)\n")
    assert run.returncode == 1
    assert verdict(run).startswith("loopline-verdict failed RuntimeError: SystemExit while loading")
    assert fake.encode() not in run.stdout and fake.encode() in run.stderr


def test_judge_refuses_objects_that_are_not_plain_data() -> None:
    run = judge(
        "    class Same:\n        def __eq__(self, other):\n            return True\n    return Same()\n"
    )
    assert run.returncode == 1
    assert verdict(run).startswith("loopline-verdict failed TypeError")


def test_judge_reraises_the_solutions_builtin_exceptions() -> None:
    test = "def check(candidate):\n    try:\n        candidate(1, 0)\n    except ZeroDivisionError:\n        return\n    raise AssertionError('no error')\n"
    run = judge("    return a / b\n", test=test)
    assert run.returncode == 0 and verdict(run) == f"loopline-verdict passed {NONCE}", run.stdout


# ---------------------------------------------------------------------------------------------
# The zygote, run as `python zygote.py CONTROL_FD SCRATCH MAIN` under a leased uid
# ---------------------------------------------------------------------------------------------


class Zygote:
    """A zygote started by hand under `uid`, and the host's half of its protocol."""

    def __init__(self, uid: int, script: Path, scratch: Path) -> None:
        self.uid, self.scratch = uid, scratch
        self.control, theirs = socket.socketpair()
        with theirs:
            self.proc = subprocess.Popen(
                [
                    shutil.which("setpriv") or "setpriv",
                    f"--reuid={uid}",
                    f"--regid={uid}",
                    "--clear-groups",
                    "--",
                ]
                + [
                    str(PYTHON),
                    "-I",
                    "-S",
                    str(script),
                    str(theirs.fileno()),
                    str(scratch),
                    str(scratch / "main.py"),
                ],
                pass_fds=(theirs.fileno(),),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
        self.control.settimeout(60)
        assert self.line() == "ready", self.proc.stderr.read() if self.proc.poll() is not None else ""

    def line(self) -> str:
        data = b""
        while not data.endswith(b"\n"):
            chunk = self.control.recv(64)
            if not chunk:
                break
            data += chunk
        return data.decode().strip()

    def run(self, source: str, stdin: bytes = b"") -> tuple[str, str, str]:
        """(stdout, stderr, "EXIT_STATUS CLEAN") of one run."""
        program = os.memfd_create("main.py")
        os.write(program, source.encode())
        os.lseek(program, 0, os.SEEK_SET)
        stdin_r, stdin_w = os.pipe()
        stdout_r, stdout_w = os.pipe()
        stderr_r, stderr_w = os.pipe()
        socket.send_fds(self.control, [b"r"], [program, stdin_r, stdout_w, stderr_w])
        for fd in (program, stdin_r, stdout_w, stderr_w):
            os.close(fd)
        os.write(stdin_w, stdin)
        os.close(stdin_w)
        with open(stdout_r, "rb") as out, open(stderr_r, "rb") as err:  # small outputs: no deadlock
            stdout, stderr = out.read().decode(), err.read().decode()
        return stdout, stderr, self.line()

    def close(self) -> int:
        self.control.close()  # the zygote exits when the host hangs up
        code = self.proc.wait(timeout=60)
        self.proc.stdout.close()
        self.proc.stderr.close()
        return code


@pytest.fixture
def zygote() -> Iterator[Zygote]:
    with UidLease() as uid:
        script_dir = Path(tempfile.mkdtemp(prefix="loopline-zygote-"))
        scratch = Path(tempfile.mkdtemp(prefix="loopline-zygote-scratch-"))
        try:
            script_dir.chmod(0o755)
            script = script_dir / "zygote.py"
            shutil.copy(ZYGOTE, script)
            script.chmod(0o444)
            os.chown(scratch, uid, uid)
            z = Zygote(uid, script, scratch)
            yield z
            assert z.close() == 0
        finally:
            kill_uid(uid)
            shutil.rmtree(script_dir, ignore_errors=True)
            shutil.rmtree(scratch, ignore_errors=True)


_NEEDS_UID = needs(
    ROOT and PYTHON is not None and shutil.which("setpriv"),
    "the zygote kills every process of its uid: it runs under a leased uid, which needs root and setpriv",
)


@_NEEDS_UID
def test_zygote_runs_a_program_as_python_main_would(zygote: Zygote) -> None:
    source = "import sys\nprint(sys.stdin.read().upper(), sys.argv[0], __name__)\nsys.exit(7)\n"
    stdout, stderr, report = zygote.run(source, stdin=b"hello")
    assert stdout.split() == ["HELLO", str(zygote.scratch / "main.py"), "__main__"], stderr
    assert report == "7 1"
    stdout, _, report = zygote.run("import os\nprint(os.getcwd(), os.getuid())\n")
    assert stdout.split() == [str(zygote.scratch), str(zygote.uid)] and report == "0 1"


@_NEEDS_UID
def test_zygote_reports_an_uncaught_exception_as_exit_1(zygote: Zygote) -> None:
    _, stderr, report = zygote.run("def f():\n    raise ValueError('boom')\nf()\n")
    assert report == "1 1"
    assert "ValueError: boom" in stderr and "_zygote_child" not in stderr  # its own frame is hidden


@_NEEDS_UID
def test_zygote_kills_leftovers_and_wipes_scratch(zygote: Zygote) -> None:
    body = (
        "import os, sys, time\nos.makedirs('a/b')\nopen('a/b/f', 'w').write('x')\nopen('top', 'w').write('y')\n"
        "if os.fork() == 0:\n    os.setsid()\n    os.close(1)\n    os.close(2)\n    time.sleep(600)\n"
    )
    _, stderr, report = zygote.run(body)
    assert report == "0 1", stderr
    assert os.listdir(zygote.scratch) == []
    # Only the zygote is left; the host's copy of the /proc scan agrees with the zygote's own.
    inside = runpy.run_path(str(ZYGOTE), run_name="zygote")["_pids_of_uid"]
    # (setpriv exec()s python: the zygote's pid is the one Popen started)
    assert pids_of_uid(zygote.uid) == inside(zygote.uid) == [zygote.proc.pid]


@needs(ROOT and PYTHON is not None, "the zygote's refusal to run as root is seen as root")
def test_zygote_refuses_to_run_as_root() -> None:
    run = subprocess.run([str(PYTHON), "-I", "-S", str(ZYGOTE)], capture_output=True, timeout=60)
    assert run.returncode == 1 and b"refusing to run as root" in run.stderr
