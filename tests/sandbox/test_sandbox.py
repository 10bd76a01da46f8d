"""Hostile programs against the sandbox: each is stopped or refused and reported, nothing outside is touched,
and the test process keeps running. Limits are small so the suite stays fast."""
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from megalign.sandbox import Outcome, Sandbox, SandboxPool, unavailable_reason


pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=f"no sandbox here: {unavailable_reason()}")


@pytest.fixture
def box():
    return Sandbox(timeout_s=2, cpu_s=1, memory_mb=256, output_bytes=4096, file_mb=1, nproc=16)


def test_ok_program_reads_stdin_and_prints(box):
    out = box.run("import sys\nn = int(sys.stdin.read())\nprint(n * n)\n", stdin="12")
    assert (out.status, out.exit_code, out.stdout, out.limit) == ("ok", 0, "144\n", None)


def test_exception_is_error_with_traceback(box):
    out = box.run("raise ValueError('nope')")
    assert (out.status, out.exit_code) == ("error", 1)
    assert "ValueError: nope" in out.stderr


FAILING_ASSERT = """import linecache, sys
print(sorted(linecache.cache))
linecache.getline("main.py", 1)  # fills this run's copy of the cache
start = set(sys.modules)


class Spy:
    '''stderr as the sandbox's error path sees it; its first flush (the traceback's end) reports the modules
    imported since start.'''

    def __init__(self, real):
        self.real = real
        self.reported = False

    def write(self, text):
        return self.real.write(text)

    def flush(self):
        if not self.reported:
            self.real.write(f"imported by the error path: {sorted(set(sys.modules) - start)}\\n")
            self.reported = True
        self.real.flush()


sys.stderr = Spy(sys.stderr)


def f(x):
    assert x + 1 == 3, 'f got ' + str(x)


f(5)
"""


def test_failing_assert_prints_its_traceback_without_importing(box):
    # A failing program's traceback is printed as `python main.py` prints it (its own frames, source lines read
    # from /work/main.py, carets), the printing imports nothing (_boot.py imports what it needs before forking),
    # and linecache's cache is empty in each run although the run before filled its own copy (the server's
    # modules carry nothing of one execution into the next).
    for _ in range(2):
        out = box.run(FAILING_ASSERT)
        assert (out.status, out.exit_code, out.stdout) == ("error", 1, "[]\n")
        assert out.stderr == ("Traceback (most recent call last):\n"
                              '  File "main.py", line 32, in <module>\n'
                              "    f(5)\n"
                              '  File "main.py", line 29, in f\n'
                              "    assert x + 1 == 3, 'f got ' + str(x)\n"
                              "           ^^^^^^^^^^\n"
                              "AssertionError: f got 5\n"
                              "imported by the error path: []\n")


def test_bash_programs_run_too(box):
    out = box.run("read n\necho $((n * 7))\n", stdin="6\n", language="bash")
    assert (out.status, out.stdout) == ("ok", "42\n")


def test_exit_code_is_kept(box):
    assert box.run("import sys; sys.exit(3)").exit_code == 3


def test_infinite_loop_hits_cpu_limit(box):
    out = box.run("while True:\n    pass\n")
    assert (out.status, out.limit) == ("cpu_limit", "cpu")
    assert out.cpu_time_s >= 0.9


def test_sleeping_program_hits_wall_timeout():
    out = Sandbox(timeout_s=0.5).run("import time\ntime.sleep(30)\n")
    assert (out.status, out.limit) == ("timeout", "wall")
    assert out.wall_time_s < 5


def test_ten_gigabyte_allocation_is_refused(box):
    out = box.run("x = bytearray(10 * 1024 ** 3)\nprint('allocated')\n")
    assert (out.status, out.limit) == ("memory_limit", "memory")
    assert "allocated" not in out.stdout


def test_huge_stdout_is_capped_and_stopped(box):
    out = box.run("while True:\n    print('x' * 1000)\n")
    assert (out.status, out.limit, out.stdout_truncated) == ("output_limit", "output", True)
    assert len(out.stdout) == 4096


def test_big_file_hits_file_size_limit(box):
    out = box.run("open('big', 'wb').write(b'x' * (4 << 20))\n")
    assert (out.status, out.limit) == ("output_limit", "file_size")


def test_fork_bomb_is_contained_and_cleaned_up():
    box = Sandbox(timeout_s=1, cpu_s=1, memory_mb=256, nproc=16)
    program = ("import os\n"
               "while True:\n"
               "    try:\n"
               "        os.fork()\n"
               "    except OSError:\n"
               "        pass\n")
    out = box.run(program)
    assert out.status in ("cpu_limit", "timeout", "killed")
    time.sleep(0.2)
    ps = subprocess.run(["ps", "-e", "-o", "uid="], capture_output=True, text=True).stdout.split()
    assert str(box.uid_base) not in ps  # no process of the sandbox uid survives


def test_escaped_daemon_is_killed_at_the_end(box, tmp_path):
    # A child that leaves the process group with setsid() and outlives the program.
    program = ("import os, time\n"
               "if os.fork() == 0:\n"
               "    os.setsid()\n"
               "    time.sleep(60)\n"
               "print('parent done')\n")
    out = box.run(program)
    assert out.status == "ok"
    time.sleep(0.2)
    ps = subprocess.run(["ps", "-e", "-o", "uid="], capture_output=True, text=True).stdout.split()
    assert str(box.uid_base) not in ps


def test_writing_outside_the_working_directory_is_refused(box, tmp_path):
    run_dir = tmp_path / "run_dir"
    run_dir.mkdir()
    os.chmod(tmp_path, 0o777)
    os.chmod(run_dir, 0o777)  # writable by anyone on the host: only the sandbox can stop the write
    target = run_dir / "pwned.txt"
    out = box.run(f"open({str(target)!r}, 'w').write('x')\n")
    assert out.status == "error"
    assert "FileNotFoundError" in out.stderr or "PermissionError" in out.stderr
    for path in ("/tmp/pwned.txt", "/pwned.txt"):
        out = box.run(f"open({path!r}, 'w').write('x')\n")
        assert out.status == "error"
    assert not target.exists() and not os.path.exists("/tmp/pwned.txt")


def test_reading_a_checkpoint_outside_is_refused(box, tmp_path):
    ckpt = tmp_path / "checkpoints" / "step_10"
    ckpt.mkdir(parents=True)
    (ckpt / "model.safetensors").write_text("secret weights")
    os.chmod(tmp_path, 0o755)
    for d in (tmp_path / "checkpoints", ckpt):
        os.chmod(d, 0o755)
    os.chmod(ckpt / "model.safetensors", 0o644)  # world-readable on the host
    out = box.run(f"print(open({str(ckpt / 'model.safetensors')!r}).read())\n")
    assert out.status == "error" and "secret" not in out.stdout
    assert "FileNotFoundError" in out.stderr
    listing = box.run("import os\nprint(sorted(os.listdir('/')))\nprint(os.listdir('/work'))\n").stdout.splitlines()
    prefix_top = os.path.realpath(sys.base_prefix).split("/")[1]  # the interpreter's prefix, e.g. root for ~/.pyenv
    allowed = {".old", "bin", "sbin", "lib", "lib32", "lib64", "usr", "dev", "work", prefix_top}
    assert "work" in eval(listing[0]) and set(eval(listing[0])) <= allowed
    assert listing[1] == "['main.py']"


def test_socket_to_a_listening_server_of_the_test_is_refused(box):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    out = box.run(f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\nprint('connected')\n")
    server.settimeout(0.05)
    with pytest.raises(socket.timeout):
        server.accept()  # a connection would sit in the backlog even though the sandbox has exited
    server.close()
    assert out.status == "error" and "connected" not in out.stdout
    assert "Network is unreachable" in out.stderr


def test_the_program_cannot_regain_privileges(box):
    out = box.run("import os\nos.setuid(0)\n")
    assert out.status == "error" and "PermissionError" in out.stderr


def test_working_directory_is_removed(box):
    before = {p for p in os.listdir("/tmp") if p.startswith("megalign-sandbox-")}
    box.run("open('f', 'w').write('x')\n")
    after = {p for p in os.listdir("/tmp") if p.startswith("megalign-sandbox-")}
    assert after <= before


def test_pool_runs_in_parallel_and_keeps_order(box):
    with SandboxPool(2, box) as pool:
        outs = pool.map([f"print({i} * 3)" for i in range(6)])
    assert [o.stdout for o in outs] == [f"{i * 3}\n" for i in range(6)]


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="timeout_s"):
        Sandbox(timeout_s=0)
    with pytest.raises(ValueError, match="language"):
        Sandbox().run("1", language="ruby")
    with pytest.raises(ValueError, match="workers"):
        SandboxPool(0)


def test_cli_prints_the_outcome_as_json(tmp_path):
    prog = tmp_path / "p.py"
    prog.write_text("print('hello')\n")
    res = subprocess.run([sys.executable, "-m", "megalign.sandbox", str(prog), "--timeout", "2"],
                         capture_output=True, text=True, check=True)
    outcome = json.loads(res.stdout)
    assert outcome["status"] == "ok" and outcome["stdout"] == "hello\n"
    assert set(outcome) == {f.name for f in Outcome.__dataclass_fields__.values()}


def test_an_interrupted_run_leaves_nothing_running_and_the_sandbox_keeps_working():
    # A reward timeout (SafeReward's SIGALRM) may interrupt run() anywhere; the program must not outlive it.
    import signal

    class Interrupted(BaseException):
        pass

    def expire(signum, frame):
        raise Interrupted

    box = Sandbox(timeout_s=30, uid_base=210_000)
    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, 0.3)
    try:
        with pytest.raises(Interrupted):
            box.run("import time\ntime.sleep(30)\n")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    time.sleep(0.2)
    ps = subprocess.run(["ps", "-e", "-o", "uid="], capture_output=True, text=True).stdout.split()
    assert "210000" not in ps
    assert box.run("print('again')").stdout == "again\n"
    box.close()
