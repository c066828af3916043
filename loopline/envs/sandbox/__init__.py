"""Run untrusted, model-written Python under OS isolation and hard resource limits.

Two isolation levels, chosen by `SandboxConfig.isolation`:

- "bwrap": bubblewrap. No network (own net namespace), own PID/IPC/UTS namespaces, an empty
  root with only /usr (plus /bin, /lib symlinks) and the interpreter's install bound read-only,
  a fresh /proc and /dev, a size-capped private tmpfs on /tmp as the scratch dir, a cleared
  environment, --die-with-parent and --new-session.
- "process": a plain subprocess with the same rlimits and a scratch dir in the host's temp dir.
  The code sees the host file system and network: a loud warning is logged.

When the host runs as root, the code runs under a uid of its own, leased per sandbox process.
Limits are set by `prlimit` before the interpreter starts, so they cover the whole process tree;
the wall-clock limit is enforced from outside by killing the session (and, for bwrap, the PID
namespace dies with its init). Warm sandboxes (`reuse_runs` > 0) serve many runs from one
sandboxed zygote; the zygote is non-dumpable, so runs (same uid) cannot ptrace it or read its
memory or fds; they can only kill it, which ends that sandbox.

The trust boundary is a file boundary. What runs inside the sandbox is in `inside/`: standalone
programs (standard library only), copied into the sandbox as files:

    inside/zygote.py   the warm sandbox's zygote: forks a child per run, cleans up after each
    inside/judge.py    the code env's judge (loopline.envs.code): tests a completion it isolates

Everything else is the host side:

    config.py    SandboxConfig (isolation, limits), SandboxError, fixed names
    result.py    SandboxResult
    runner.py    Sandbox: one run, fresh or on the warm sandbox
    warm.py      the warm sandbox: starts the zygote and talks to it
    commands.py  bwrap / prlimit / setpriv command lines, the interpreter, the bwrap probe
    uids.py      leased sandbox uids; finding and killing a sandbox's processes
    streams.py   stdin feeding and output tails
    programs.py  the source of the inside/ programs
"""

from loopline.envs.sandbox.commands import bwrap_problem, readable_by_others, resolve_python
from loopline.envs.sandbox.config import SandboxConfig, SandboxError
from loopline.envs.sandbox.programs import inside_source
from loopline.envs.sandbox.result import SandboxResult
from loopline.envs.sandbox.runner import Sandbox
from loopline.envs.sandbox.uids import pids_of_uid

__all__ = [
    "Sandbox",
    "SandboxConfig",
    "SandboxError",
    "SandboxResult",
    "bwrap_problem",
    "inside_source",
    "pids_of_uid",
    "readable_by_others",
    "resolve_python",
]
