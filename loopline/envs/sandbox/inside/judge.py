"""The code env's judge: runs inside the sandbox, tests a completion it never lets touch the test.

Standalone (standard library only): the host (`loopline.envs.code.score`) runs this file's text
as the sandbox's program, with stdin = marshal.dumps({"nonce", "prompt", "solution", "test",
"entry_point", "tally"}). It forks the solution process first, makes itself non-dumpable, reads the
payload, runs prompt + test + check(candidate) where each candidate(*args) call goes over a pipe to
the solution process, and prints its verdict as the last line of stdout:

    loopline-verdict passed NONCE      (exit status 0: check() returned)
    loopline-verdict tally K N NONCE   (tally: check() ran to its end, K of its N tests passed)
    loopline-verdict failed WHY        (exit status 1, or 2 when the judge itself cannot run)

With "tally", each top-level statement of check's body that holds an assert is one test: a test
that fails or raises is counted and the next one runs (see `_tallied`).

Everything the test or the solution prints goes to stderr. See `loopline/envs/code.py` for why
the verdict cannot be forged from the solution side.
"""

from __future__ import annotations

import builtins
import marshal
import os
import sys

VERDICT = "loopline-verdict"  # the host parses the same marker (loopline.envs.code.VERDICT)
# Frame = 8-byte little-endian length + marshal bytes. marshal is built in (no import cost at
# start-up) and only ever builds built-in types; what the judge reads is checked by `_plain`
# anyway, and a frame that does not parse is a failed check.
MAX_FRAME = 64 << 20


def _plain(value: object, depth: int = 0) -> object:
    """`value` if it is built-in data all the way down (exact types), else TypeError."""
    kind = type(value)
    if value is None or kind in (bool, int, float, complex, str, bytes):
        return value
    if depth > 200:
        raise TypeError("value nested too deeply to cross the sandbox boundary")
    if kind in (list, tuple, set, frozenset):
        for item in value:
            _plain(item, depth + 1)
        return value
    if kind is dict:
        for key, item in value.items():
            _plain(key, depth + 1)
            _plain(item, depth + 1)
        return value
    raise TypeError(f"a value of type {kind.__name__} cannot cross the sandbox boundary (built-in data only)")


def _send(fd: int, value: object) -> None:
    """Write one frame holding `value` to a blocking fd."""
    body = marshal.dumps(value, 4)
    data = memoryview(len(body).to_bytes(8, "little") + body)
    while data:
        data = data[os.write(fd, data) :]


def _receive(stream: object) -> object:
    """Read one frame from a binary stream; EOFError if the writer is gone."""
    header = stream.read(8)
    if len(header) < 8:
        raise EOFError("the other process exited (or closed its pipe) before answering")
    size = int.from_bytes(header, "little")
    if size > MAX_FRAME:
        raise ValueError(f"frame of {size} bytes exceeds the {MAX_FRAME}-byte limit")
    body = stream.read(size)
    if len(body) < size:
        raise EOFError("the other process exited in the middle of a message")
    return marshal.loads(body)


def _flush(*streams: object) -> None:
    """Flush Python-level buffers before os._exit (which skips that)."""
    for stream in streams:
        try:  # noqa: SIM105 - no contextlib import at start-up
            stream.flush()
        except Exception:
            pass  # a stream the solution closed or replaced


def _solution_main(requests_fd: int, answers_fd: int) -> None:
    """Solution process: run prompt + completion, then answer calls until the judge hangs up."""
    requests = open(requests_fd, "rb")  # noqa: SIM115 - lives as long as this process
    first = _receive(requests)
    namespace: dict[str, object] = {"__name__": "__solution__"}
    try:
        exec(compile(first["source"], "<solution>", "exec"), namespace)
        function = namespace[first["entry_point"]]
    except BaseException as e:  # noqa: BLE001 - any failure to load is reported, not raised
        _send(answers_fd, {"error": f"{type(e).__name__} while loading the solution: {e}"})
        return
    _send(answers_fd, {"ok": True})
    while True:
        try:
            args, kwargs = _receive(requests)
        except EOFError:
            return
        try:
            answer = {"return": _plain(function(*args, **kwargs))}
        except Exception as e:
            answer = {"raise": type(e).__name__, "message": str(e)[:2000]}
        _send(answers_fd, answer)


def _tallied(test: str) -> tuple[object, list[int]]:
    """`test` compiled with each assert-holding top-level statement of check's body wrapped so that its
    failure is counted, not raised; returns (code, tally), tally = [passed, total] filled as check runs."""
    import ast

    tree = ast.parse(test, "<test>")
    tally = [0, 0]
    for node in tree.body:
        if not (isinstance(node, ast.FunctionDef) and node.name == "check"):
            continue
        body = []
        for stmt in node.body:
            if not any(isinstance(n, ast.Assert) for n in ast.walk(stmt)):
                body.append(stmt)
                continue
            tally[1] += 1
            counted = ast.parse(
                "try:\n    pass\nexcept Exception:\n    pass\nelse:\n    __tally__[0] += 1"
            ).body[0]
            counted.body = [stmt]  # type: ignore[attr-defined]
            body.append(counted)
        node.body = body
    return compile(ast.fix_missing_locations(tree), "<test>", "exec"), tally


def _fork_solution() -> tuple[int, int, int]:
    """Fork the solution process: (its pid, the pipe the judge writes requests to, the one it reads answers from).

    Forked first, while the judge holds nothing secret (the payload and its nonce are still unread on stdin): the
    child shares no secret memory with the judge, and costs no interpreter start-up of its own."""
    requests_r, requests_w = os.pipe()
    answers_r, answers_w = os.pipe()
    solution = os.fork()
    if solution == 0:
        try:
            devnull = os.open(os.devnull, os.O_RDONLY)
            os.dup2(devnull, 0)  # not the payload
            os.dup2(2, 1)  # not the verdict stream: the solution's prints go to stderr
            os.close(devnull)
            os.close(requests_w)
            os.close(answers_r)
            _solution_main(requests_r, answers_w)
        finally:
            _flush(sys.stdout, sys.stderr)
            os._exit(0)  # never return into the judge's code, whatever the solution raised
    os.close(requests_r)
    os.close(answers_w)
    return solution, requests_w, answers_r


def _judge_main() -> None:
    """Judge process: fork the solution process, run the test against it, print the verdict."""
    solution, requests_w, answers_r = _fork_solution()  # first: see there

    import ctypes

    verdict_fd = os.dup(1)  # only the judge writes the verdict stream...
    os.dup2(2, 1)  # ...and anything the test prints goes to stderr

    def verdict(line: str) -> None:
        _flush(sys.stdout, sys.stderr)  # what the test printed, before the process ends
        # Hang up on the solution process and wait for it: it flushes what it printed and exits.
        # The sandbox kills whatever is left of a run once its main process (this one) has ended,
        # so output the solution still held in its buffers would be lost.
        try:
            os.close(requests_w)
            os.waitpid(solution, 0)
        except OSError:
            pass  # (the test closed that pipe or reaped the process: nothing to wait for)
        os.write(verdict_fd, ("\n" + VERDICT + " " + line.replace("\n", " ") + "\n").encode())

    # Non-dumpable before the nonce enters memory: other processes of this uid (the solution)
    # can then neither ptrace us nor open our /proc/<pid>/{mem,fd,environ}.
    if ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE = 4
        verdict("failed judge: prctl(PR_SET_DUMPABLE, 0) failed")
        os._exit(2)
    payload = marshal.loads(sys.stdin.buffer.read())
    nonce = payload.pop("nonce")
    answers = open(answers_r, "rb")  # noqa: SIM115 - lives as long as this process

    def exchange(message: object) -> dict[str, object]:
        _send(requests_w, message)
        answer = _plain(_receive(answers))
        if type(answer) is not dict:
            raise ValueError("malformed answer from the solution process")
        return answer

    def candidate(*args: object, **kwargs: object) -> object:
        answer = exchange((_plain(args), _plain(kwargs)))
        if "return" in answer:
            return answer["return"]
        name, message = str(answer.get("raise")), str(answer.get("message"))
        error = getattr(builtins, name, None)
        if isinstance(error, type) and issubclass(error, Exception):
            raise error(message)
        raise RuntimeError(f"{name}: {message}")

    try:
        loaded = exchange({"source": payload["solution"], "entry_point": payload["entry_point"]})
        if loaded.get("ok") is not True:
            raise RuntimeError(str(loaded.get("error", "the solution did not load")))
        namespace: dict[str, object] = {"__name__": "__judge__"}
        # Helpers defined in the prompt (e.g. HumanEval/32's `poly`) come from the problem.
        try:  # noqa: SIM105 - contextlib would cost an import at start-up
            exec(compile(payload["prompt"], "<prompt>", "exec"), namespace)
        except SyntaxError:
            pass  # a prompt that is not valid code on its own defines no helpers
        namespace[payload["entry_point"]] = candidate
        if payload.get("tally"):
            code, tally = _tallied(payload["test"])
            namespace["__tally__"] = tally
        else:
            code, tally = compile(payload["test"], "<test>", "exec"), None
        exec(code, namespace)
        namespace["check"](candidate)
    except BaseException as e:  # noqa: BLE001 - every failure is a verdict
        tb = e.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        where = f" ({tb.tb_frame.f_code.co_filename} line {tb.tb_lineno})" if tb else ""
        verdict(f"failed {type(e).__name__}: {str(e)[:500]}{where}")
        os._exit(1)
    verdict(f"tally {tally[0]} {tally[1]} {nonce}" if tally and tally[1] else f"passed {nonce}")
    os._exit(0)


if __name__ == "__main__":
    _judge_main()
