"""The sandbox's fork server: run as `python -I -S _boot.py SOCKET_FD` (stdlib only, never imports megalign).

One server per `Sandbox`, started on its first run, so an execution costs two forks of this small process
instead of an interpreter start-up. Process tree of one execution (see `megalign.sandbox` for what each
step enforces):

    server (this script: waits for requests on a SEQPACKET socket from the parent)
    └── launcher (forked per request, a session of its own, the request's stdin/stdout/stderr)
          unshare(mount | network | pid [| user when not root])
          └── init: pid 1 of the new pid namespace; dies with the launcher (PDEATHSIG)
                private mounts; a read-only tmpfs root holding only the runtime (read-only binds), a few
                /dev nodes and the working directory as /work; pivot_root; the host's tree detached
                └── program: rlimits; privileges dropped (root: the sandbox uid; user namespace: all
                    capabilities); no_new_privs; nice; runs the program

init waits for the program, reaps orphans, writes `{"exit", "signal", "cpu_s"}` as JSON to the status fd
(or `{"error"}` if the setup failed) and exits, which makes the kernel kill every process left in the
pid namespace. The program never holds the status fd, so it cannot forge its outcome.

A program that fails has its traceback printed the way `python main.py` prints an uncaught exception: by
`sys.excepthook`, from the program's own frames on (the boot's frame would name the host's path of this file).
Up to Python 3.12 the interpreter's hook formats in C and imports nothing; from 3.13 it formats through the
`traceback` module, so this server imports traceback, tokenize and ast (the last two imported lazily by linecache
and traceback) once, before it forks anything. The error path used to import traceback after the fork, in every
failing program, and format in Python, which doubled a failing test's cost (on 3.11, per failing fork: +0.8 ms of
CPU for the Python formatting even with its modules pre-imported, +0.2 ms for the C hook; the error path imports
nothing new on 3.9 to 3.13). Pre-importing them gives a program nothing it could not have by importing them
itself, and nothing of another execution:
- they are the read-only standard library the program's root binds at the same paths, imported by the server
  before any execution, from code that never runs a program; they hold no file descriptor and no privilege
  (import opens and closes each source file; the program's rlimits, uid drop and no_new_privs come after);
- their mutable state is the server's, copied into each execution at the fork and never copied back: one
  program's changes (linecache's cache of /work/main.py, a patched function) die with its process, and the
  next execution forks from the unchanged server. linecache.cache is empty in every program
  (`tests/sandbox/test_sandbox.py` checks it, and that a failing program's error path imports nothing new).
The exit status stays the program's to choose, as it was: its own hook or os._exit can end it with any code.
"""
import ast  # noqa: F401  (this and tokenize: imported lazily by the error path on 3.13+, module docstring)
import ctypes
import json
import os
import resource
import signal
import socket
import sys
import tokenize  # noqa: F401
import traceback  # noqa: F401

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 8, 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
LOCKED_FLAGS = {os.ST_NOSUID: MS_NOSUID, os.ST_NODEV: MS_NODEV, os.ST_NOEXEC: MS_NOEXEC}

libc = ctypes.CDLL(None, use_errno=True)


def check(result, what):
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(source, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()
    check(libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {target}")


def bind_readonly(path, target, writable=False):
    """Bind `path` at `target`, then remount it read-only (unless `writable`) keeping the flags the kernel
    locks from the outer mount (nosuid/nodev/noexec), which a remount inside a user namespace must repeat."""
    mount(path, target, None, MS_BIND)
    locked = sum(flag for st, flag in LOCKED_FLAGS.items() if os.statvfs(path).f_flag & st)
    mount(None, target, None, MS_REMOUNT | MS_BIND | MS_NOSUID | locked | (0 if writable else MS_RDONLY))


def build_root(cfg):
    """Populate the new root (a tmpfs at cfg['root']) and pivot into it; cwd becomes /work."""
    root = cfg["root"]
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    for path in cfg["runtime"]:
        target = root + path
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if os.path.islink(path):
            os.symlink(os.readlink(path), target)
        elif os.path.isdir(path):
            os.makedirs(target, exist_ok=True)
            bind_readonly(path, target)
    os.makedirs(root + "/dev")
    for node in ("null", "zero", "random", "urandom"):
        open(f"{root}/dev/{node}", "w").close()
        mount(f"/dev/{node}", f"{root}/dev/{node}", None, MS_BIND)
    os.makedirs(root + "/work")
    bind_readonly(cfg["work"], root + "/work", writable=True)
    os.makedirs(root + "/.old")
    mount(None, root, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    number = SYS_PIVOT_ROOT[os.uname().machine]
    check(libc.syscall(ctypes.c_long(number), root.encode(), (root + "/.old").encode()), "pivot_root")
    os.chdir("/")
    check(libc.umount2(b"/.old", MNT_DETACH), "umount /.old")
    os.chdir("/work")


def drop_privileges(cfg):
    """Limits, then no way back: the sandbox uid when launched as root, no capabilities, no_new_privs."""
    for name, value in cfg["rlimits"].items():
        resource.setrlimit(getattr(resource, name), (value, value + 1 if name == "RLIMIT_CPU" else value))
    if cfg["uid"] is not None:
        os.setgroups([])
        os.setgid(cfg["uid"])
        os.setuid(cfg["uid"])
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this thread
    check(libc.capset(header, (ctypes.c_uint32 * 6)()), "capset (drop all capabilities)")
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
    os.nice(cfg["nice"])


def run_program(cfg):
    """The program's process: never returns."""
    code = 1
    try:
        drop_privileges(cfg)
        signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # Python ignores it: die at RLIMIT_FSIZE, not EFBIG
        if cfg["language"] == "bash":
            os.execv("/bin/bash", ["bash", "/work/main.sh"])
        sys.argv = ["main.py"]
        sys.path.insert(0, "/work")
        with open("/work/main.py", encoding="utf-8") as f:
            source = f.read()
        exec(compile(source, "main.py", "exec"), {"__name__": "__main__", "__file__": "/work/main.py"})
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    except BaseException as exc:
        exc.__traceback__ = exc.__traceback__.tb_next  # from the program's frame on (module docstring)
        sys.excepthook(type(exc), exc, exc.__traceback__)
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:
                pass
        os._exit(code & 0xFF)


def init(cfg, status_fd):
    """pid 1: build the root, start the program, wait for it (reaping orphans), report, exit."""
    check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PDEATHSIG)")
    try:
        build_root(cfg)
    except OSError as exc:
        os.write(status_fd, json.dumps({"error": f"sandbox setup failed: {exc}"}).encode())
        os._exit(0)
    pid = os.fork()
    if pid == 0:
        os.close(status_fd)
        run_program(cfg)
    while True:
        done, status = os.waitpid(-1, 0)
        if done == pid:
            break
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    report = {"exit": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
              "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
              "cpu_s": usage.ru_utime + usage.ru_stime}
    os.write(status_fd, json.dumps(report).encode())
    os._exit(0)


def launch(cfg, fds):
    """The launcher, forked by the server: a session of its own, the request's stdin/stdout/stderr, then the
    namespaces and init; exits when init does."""
    os.setsid()
    for target, fd in enumerate(fds[:3]):
        os.dup2(fd, target)
        os.close(fd)
    status_fd = cfg["status_fd"] = fds[3]
    try:
        flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | (CLONE_NEWUSER if os.geteuid() != 0 else 0)
        uid, gid = os.geteuid(), os.getegid()
        check(libc.unshare(flags), "unshare(mount, network, pid namespaces)")
        if flags & CLONE_NEWUSER:
            for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
                with open(f"/proc/self/{name}", "w") as f:
                    f.write(text)
    except OSError as exc:
        os.write(status_fd, json.dumps({"error": f"sandbox isolation refused by the kernel: {exc}"}).encode())
        os._exit(0)
    pid = os.fork()
    if pid == 0:
        init(cfg, status_fd)
    os.close(status_fd)
    os.waitpid(pid, 0)
    os._exit(0)


def kill_session(pid):
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def serve(sock):
    """The fork server: one request per SEQPACKET message. `{"op": "run", "cfg": ...}` with four fds (stdin,
    stdout, stderr, status) forks a launcher and answers `{"pid"}`; `{"op": "kill", "pid"}` SIGKILLs that
    launcher's session if it is still a live child (never a reused pid: only this loop reaps); end of file
    (the parent closed the socket or died) kills every live launcher and exits."""
    live = set()
    while True:
        msg, fds, _, _ = socket.recv_fds(sock, 1 << 20, 4)
        for pid in list(live):
            if os.waitpid(pid, os.WNOHANG)[0]:
                live.discard(pid)
        if not msg:
            for pid in live:
                kill_session(pid)
            os._exit(0)
        request = json.loads(msg)
        if request["op"] == "run":
            pid = os.fork()
            if pid == 0:
                sock.close()
                launch(request["cfg"], fds)
            for fd in fds:
                os.close(fd)
            live.add(pid)
            sock.send(json.dumps({"pid": pid}).encode())
        else:
            if request["pid"] in live:
                kill_session(request["pid"])
            sock.send(b"{}")


if __name__ == "__main__":
    serve(socket.socket(fileno=int(sys.argv[1])))
