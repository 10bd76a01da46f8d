"""`Sandbox.run(program)` -> `Outcome`, and `SandboxPool` for many executions at once (see the package docstring)."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional, Sequence

BOOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_boot.py")
LANGUAGES = {"python": "main.py", "bash": "main.sh"}
STATUSES = ("ok", "error", "timeout", "cpu_limit", "memory_limit", "output_limit", "killed")
UID_BASE = 200_000
"""Sandbox uids when launched as root: UID_BASE + slot, one per concurrent execution, so RLIMIT_NPROC (counted
per uid) in one execution cannot starve another's forks. Pick a base no real account uses."""


class SandboxError(RuntimeError):
    """The sandbox itself could not run the program (isolation refused by the kernel, setup failed): not the
    program's fault, so it is raised, never reported as an outcome."""


@dataclasses.dataclass
class Outcome:
    """What one execution did. `status` is one of STATUSES: ok (exit 0), error (non-zero exit: an exception,
    `exit(1)`), timeout (wall clock), cpu_limit, memory_limit (a MemoryError under RLIMIT_AS), output_limit
    (stdout/stderr over the cap, or a file over RLIMIT_FSIZE), killed (another signal). `limit` names the
    limit that stopped it (wall, cpu, memory, output, file_size) or is None."""

    status: str
    exit_code: Optional[int]
    signal: Optional[int]
    stdout: str
    stderr: str
    stdout_truncated: bool
    stderr_truncated: bool
    cpu_time_s: float
    wall_time_s: float
    limit: Optional[str]

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))


def _runtime_paths() -> list[str]:
    """What the program may read (read-only): the interpreter's prefix and the system library/binary trees."""
    prefix = os.path.realpath(sys.base_prefix)
    paths = [p for p in ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64") if os.path.lexists(p)]
    if not any(prefix == p or prefix.startswith(p + "/") for p in paths):
        paths.append(prefix)
    return paths


def _positive(name: str, value: float) -> float:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    return value


@dataclasses.dataclass
class Sandbox:
    """Limits of every execution. cpu_s defaults to the wall timeout rounded up; memory_mb is RLIMIT_AS
    (address space: a Python interpreter needs about 30 MB); output_bytes caps stdout and stderr each;
    file_mb caps each file the program writes; nproc the processes of the sandbox uid; nofile open files."""

    timeout_s: float = 5.0
    cpu_s: Optional[int] = None
    memory_mb: int = 512
    output_bytes: int = 64 * 1024
    file_mb: int = 16
    nproc: int = 32
    nofile: int = 64
    nice: int = 10
    uid_base: int = UID_BASE

    def __post_init__(self):
        for name in ("timeout_s", "memory_mb", "output_bytes", "file_mb", "nproc", "nofile"):
            _positive(name, getattr(self, name))
        self.cpu_s = int(math.ceil(self.timeout_s)) if self.cpu_s is None else int(_positive("cpu_s", self.cpu_s))
        self._python = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
        self._runtime = _runtime_paths()

    def _rlimits(self) -> dict:
        return {"RLIMIT_CPU": self.cpu_s, "RLIMIT_AS": self.memory_mb << 20, "RLIMIT_FSIZE": self.file_mb << 20,
                "RLIMIT_NPROC": self.nproc, "RLIMIT_NOFILE": self.nofile, "RLIMIT_CORE": 0}

    def run(self, program: str, stdin: str = "", language: str = "python", slot: int = 0) -> Outcome:
        """Run `program` (source text) with `stdin` as its standard input; `slot` picks the sandbox uid
        (distinct per concurrent execution; SandboxPool assigns them)."""
        if language not in LANGUAGES:
            raise ValueError(f"language must be one of {sorted(LANGUAGES)}, got {language!r}")
        if not isinstance(program, str):
            raise TypeError(f"program must be source text (str), got {type(program).__name__}")
        base = tempfile.mkdtemp(prefix="megalign-sandbox-")
        try:
            return self._run_in(base, program, stdin, language, slot)
        finally:
            shutil.rmtree(base, ignore_errors=True)

    def _run_in(self, base: str, program: str, stdin: str, language: str, slot: int) -> Outcome:
        work, root = os.path.join(base, "work"), os.path.join(base, "root")
        os.mkdir(work, 0o700)
        os.mkdir(root)
        with open(os.path.join(work, LANGUAGES[language]), "w", encoding="utf-8") as f:
            f.write(program)
        with open(os.path.join(base, "stdin"), "w", encoding="utf-8") as f:
            f.write(stdin)
        uid = self.uid_base + slot if os.geteuid() == 0 else None
        if uid is not None:
            os.chown(work, uid, uid)
            os.chown(os.path.join(work, LANGUAGES[language]), uid, uid)
        cfg = {"root": root, "work": work, "runtime": self._runtime, "rlimits": self._rlimits(), "uid": uid,
               "nice": self.nice, "language": language}
        pipes = {name: os.pipe() for name in ("stdout", "stderr", "status")}
        readers = {name: r for name, (r, _) in pipes.items()}
        server, pid, finished = self._server(), None, False
        start = time.monotonic()
        try:
            try:
                with open(os.path.join(base, "stdin"), "rb") as stdin_file:
                    fds = [stdin_file.fileno()] + [w for _, w in pipes.values()]
                    pid = server.request({"op": "run", "cfg": cfg}, fds)["pid"]
            finally:
                for _, w in pipes.values():
                    os.close(w)
            streams, status_bytes, stopped = self._collect(readers, start)
            finished = stopped is None
        finally:
            if pid is not None and not finished and server.alive():
                server.request({"op": "kill", "pid": pid})  # also when a reward timeout interrupted the wait
            for r in readers.values():
                os.close(r)
        return self._outcome(streams, status_bytes, stopped, time.monotonic() - start)

    def _server(self) -> "_ForkServer":
        """This sandbox's fork server, (re)started when it is not running."""
        with _SERVER_LOCK:
            server = self.__dict__.get("_fork_server")
            if server is None or not server.alive():
                server = self.__dict__["_fork_server"] = _ForkServer(self._python)
            return server

    def close(self) -> None:
        """Stop the fork server (it also stops when this object is collected or the process exits)."""
        server = self.__dict__.pop("_fork_server", None)
        if server is not None:
            server.close()

    def _collect(self, pipes: dict, start: float):
        """Read stdout/stderr (at most output_bytes each) and the status pipe until all close, the wall clock
        runs out or an output overflows. Returns ({name: (bytes, truncated)}, status bytes, stop reason)."""
        data = {name: bytearray() for name in pipes}
        truncated = {"stdout": False, "stderr": False}
        stopped = None
        with selectors.DefaultSelector() as sel:
            for name, fd in pipes.items():
                sel.register(fd, selectors.EVENT_READ, name)
            while sel.get_map() and stopped is None:
                left = self.timeout_s - (time.monotonic() - start)
                if left <= 0:
                    stopped = "wall"
                    break
                for key, _ in sel.select(left):
                    chunk = os.read(key.fd, 65536)
                    if not chunk:
                        sel.unregister(key.fd)
                        continue
                    buf = data[key.data]
                    if key.data != "status" and len(buf) + len(chunk) > self.output_bytes:
                        buf += chunk[: self.output_bytes - len(buf)]
                        truncated[key.data] = True
                        stopped = "output"
                        break
                    buf += chunk
        streams = {name: (bytes(data[name]), truncated[name]) for name in ("stdout", "stderr")}
        return streams, bytes(data["status"]), stopped

    def _outcome(self, streams, status_bytes: bytes, stopped: Optional[str], wall: float) -> Outcome:
        report = json.loads(status_bytes) if status_bytes else {}
        if "error" in report:
            raise SandboxError(report["error"])
        if not report and stopped is None:
            raise SandboxError(f"the sandbox launcher ended without a report; stderr: {streams['stderr'][0][-2000:]!r}")
        text = {name: raw.decode("utf-8", errors="replace") for name, (raw, _) in streams.items()}
        code, sig, cpu = report.get("exit"), report.get("signal"), report.get("cpu_s", 0.0)
        if stopped == "wall":
            status = "timeout"
        elif stopped == "output" or sig == signal.SIGXFSZ:
            status, stopped = "output_limit", stopped or "file_size"
        elif sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu >= self.cpu_s):
            status, stopped = "cpu_limit", "cpu"
        elif sig is not None:
            status = "killed"
        elif code and text["stderr"].rstrip().rpartition("\n")[2].startswith("MemoryError"):
            status, stopped = "memory_limit", "memory"
        else:
            status = "ok" if code == 0 else "error"
        return Outcome(status, code, sig, text["stdout"], text["stderr"], streams["stdout"][1], streams["stderr"][1],
                       round(cpu, 4), round(wall, 4), stopped)


_SERVER_LOCK = threading.Lock()
_UNAVAILABLE: dict[str, Optional[str]] = {}


def unavailable_reason() -> Optional[str]:
    """Why the kernel refuses this machine's sandbox (the SandboxError of a trial run of `pass`), or None when it
    works; checked once per process, for start-up checks and for tests to skip on."""
    if "reason" not in _UNAVAILABLE:
        box = Sandbox(timeout_s=5)
        try:
            box.run("pass")
            _UNAVAILABLE["reason"] = None
        except SandboxError as exc:
            _UNAVAILABLE["reason"] = str(exc)
        finally:
            box.close()
    return _UNAVAILABLE["reason"]


class _ForkServer:
    """The `_boot.py` server process and its socket; requests from many threads are serialised by a lock
    (each is a fork and a reply: well under a millisecond)."""

    def __init__(self, python: str):
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.proc = subprocess.Popen([python, "-I", "-S", BOOT, str(theirs.fileno())], pass_fds=(theirs.fileno(),),
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     env={"PATH": "/usr/bin:/bin", "TMPDIR": "/work", "HOME": "/work",
                                          "LANG": "C.UTF-8"})
        theirs.close()
        self.sock = mine
        self.lock = threading.Lock()

    def alive(self) -> bool:
        return self.proc.poll() is None and self.sock.fileno() >= 0

    def request(self, message: dict, fds: Sequence[int] = ()) -> dict:
        with self.lock:
            try:
                socket.send_fds(self.sock, [json.dumps(message).encode()], list(fds))
                reply = self.sock.recv(1 << 16)
            except BaseException:
                self.close()  # a request cut in half (a reward timeout's signal) leaves the protocol unusable
                raise
        if not reply:
            self.close()
            raise SandboxError("the sandbox fork server exited; it is restarted on the next run")
        return json.loads(reply)

    def close(self) -> None:
        self.sock.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class SandboxPool:
    """At most `workers` executions at once (threads that wait on sandbox processes, so the GIL is free while
    programs run); `submit` returns a Future, `map` runs a batch. Each running execution gets its own slot,
    hence its own sandbox uid. Pick `workers` below the cores left over by training: the programs run at
    `nice` 10 so the trainer keeps priority."""

    def __init__(self, workers: int, sandbox: Optional[Sandbox] = None):
        if not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers must be a positive integer, got {workers!r}")
        self.sandbox = sandbox or Sandbox()
        self._slots = list(range(workers))
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="megalign-sandbox")

    def _run(self, program: str, stdin: str, language: str) -> Outcome:
        with self._lock:
            slot = self._slots.pop()
        try:
            return self.sandbox.run(program, stdin, language, slot)
        finally:
            with self._lock:
                self._slots.append(slot)

    def submit(self, program: str, stdin: str = "", language: str = "python") -> Future:
        return self._executor.submit(self._run, program, stdin, language)

    def map(self, programs: Sequence[str], stdins: Optional[Sequence[str]] = None, language: str = "python") -> list[Outcome]:
        stdins = [""] * len(programs) if stdins is None else stdins
        if len(stdins) != len(programs):
            raise ValueError(f"stdins has {len(stdins)} entries for {len(programs)} programs")
        return [f.result() for f in [self.submit(p, s, language) for p, s in zip(programs, stdins)]]

    def close(self) -> None:
        """Wait for the running executions, then stop the sandbox's fork server."""
        self._executor.shutdown(wait=True)
        self.sandbox.close()

    def __enter__(self) -> "SandboxPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
