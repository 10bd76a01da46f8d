"""A local sandbox for code-execution rewards and tools: run untrusted program text, get an `Outcome`.

`Sandbox(timeout_s=2).run("print(1)")` runs the program in a fresh process tree and returns its status
(ok / error / timeout / cpu_limit / memory_limit / output_limit / killed), exit code, truncated stdout and
stderr, CPU and wall time and the limit that stopped it; `SandboxPool(workers)` runs many at once with a
bounded number of workers; `python -m megalign.sandbox PROGRAM [--timeout S]` prints one outcome as JSON.

What every execution gets (`_boot.py` maps the process tree: a fork server, one per `Sandbox`, run by the base
interpreter with `-I -S`, forks a launcher per execution, so no interpreter starts per run; a failing program's
traceback is printed by the interpreter's own hook, whose modules the server imports before it forks):

- Limits (setrlimit in the program's process): RLIMIT_CPU (SIGXCPU, SIGKILL one second later),
  RLIMIT_AS (a MemoryError for Python), RLIMIT_FSIZE (SIGXFSZ), RLIMIT_NPROC, RLIMIT_NOFILE,
  RLIMIT_CORE = 0; a wall-clock timeout in the parent; stdout and stderr read through a selector and
  capped (the program is killed at the cap, nothing is buffered beyond it); `nice` 10.
- Processes: the launcher runs in a session of its own; the program runs under pid 1 of a new pid
  namespace, which dies with the launcher (PDEATHSIG). When the program ends, pid 1 exits and the kernel
  kills every process left in the namespace, including ones that called setsid() to leave the process
  group; when a limit stops it (or its caller is interrupted) the launcher's session is SIGKILLed first.
- Network: a new network namespace with only a loopback interface that is down: no connection to the
  host's 127.0.0.1 or anywhere else.
- Files: a new mount namespace whose root is a read-only tmpfs holding only the runtime (read-only
  binds of /usr, /bin, /lib*, and the interpreter's prefix when it lies elsewhere), /dev/null, zero,
  random, urandom, and the execution's empty temporary working directory as /work (cwd, HOME and
  TMPDIR); pivot_root and a detached old root leave nothing of the host tree reachable: no run
  directory, checkpoints, data or home. The directory is removed afterwards.
- Privileges: launched as root, the program runs as uid/gid `UID_BASE + slot` with no supplementary
  groups; launched as another user, the launcher enters a user namespace first (mapping that user to
  root inside it, which the mounts need). Either way the program then drops every capability and
  sets no_new_privs, so it can neither regain privileges nor undo the mounts.
- Python programs run with the interpreter's standard library only (`-I -S`: no site-packages, no
  environment variables read); `language="bash"` runs /bin/bash on the program instead.

Where the kernel refuses the namespaces (a container without CAP_SYS_ADMIN, user namespaces disabled),
`run` raises `SandboxError` naming what was refused (`unavailable_reason()` tells ahead): no program
ever runs with less isolation than described here. Not enforced: a limit on the memory of all processes together (RLIMIT_AS is per
process: nproc x memory_mb bounds it) and on disk use beyond file_mb per file in /work.
"""
from megalign.sandbox.core import (LANGUAGES, STATUSES, UID_BASE, Outcome, Sandbox, SandboxError, SandboxPool,
                                   unavailable_reason)

__all__ = ["LANGUAGES", "STATUSES", "UID_BASE", "Outcome", "Sandbox", "SandboxError", "SandboxPool",
           "unavailable_reason"]
