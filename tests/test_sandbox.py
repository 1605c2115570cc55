"""The code environment contains what a completion does (timetotrain/tasks/envs/sandbox.py): an infinite loop, a fork
bomb, a flood of output, writes outside its scratch directory, a network connection, a memory hog. Each is
tried with every guard on (the reward is 0 and the side effect did not happen), and the OS guards are tried
again without the Python audit hook, so a test fails if the OS layer alone would let it through (skipped,
with the reason, where this host does not permit namespaces or running as `nobody`)."""

import os
import socket
import time
from pathlib import Path

import pytest

from timetotrain.tasks.envs import CodeRunner, ExactAnswer, Limits, Problem, containment
from timetotrain.tasks.envs.sandbox import LIMIT_KILL, NOBODY, run_python

pytestmark = pytest.mark.bad_input

FAST = Limits(wall_s=1.0, cpu_s=1, processes=8, file_bytes=64 << 10, memory_bytes=512 << 20)
OS_ONLY = Limits(**{**FAST.__dict__, "python_guard": False})
ADD = Problem("add(a, b)", tests="assert add(2, 3) == 5\nassert add(-1, 1) == 0\n")


def _leftovers() -> list[int]:
    """Processes still alive from a sandbox run (they carry its scratch directory as HOME)."""
    found = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if b"ttt-sandbox-" in (p / "environ").read_bytes():
                    found.append(int(p.name))
            except OSError:
                pass
    return found


def _needs(what: str, value: str):
    if containment()[what] != value:
        pytest.skip(f"this host gives no {value} ({what}: {containment()[what]})")


def test_a_correct_completion_earns_the_reward_and_a_wrong_one_does_not():
    runner = CodeRunner(FAST)
    assert runner.score(ADD, "def add(a, b):\n    return a + b\n").reward == 1.0
    wrong = runner.score(ADD, "def add(a, b):\n    return a - b\n")
    assert wrong.reward == 0.0 and "AssertionError" in wrong.reason
    assert runner.score(ADD, "def add(a, b) return").reward == 0.0  # a syntax error is a reward of 0


def test_exact_answer():
    env = ExactAnswer()
    p = Problem("12+34=", answer="46")
    assert [env.score(p, c).reward for c in ("46", " 46\nmore", "47", "", "4 6")] == [1, 1, 0, 0, 0]


@pytest.mark.parametrize("limits", [FAST, OS_ONLY], ids=["all-guards", "os-guards"])
def test_an_infinite_loop_is_killed_at_the_wall_clock_limit(limits):
    t0 = time.monotonic()
    out = CodeRunner(limits).score(ADD, "while True:\n    pass\n")
    assert out.reward == 0.0 and out.reason in (
        "timeout",
        "killed by SIGXCPU",
        "killed by SIGKILL",
        LIMIT_KILL,
    )
    assert time.monotonic() - t0 < limits.wall_s + 5
    assert _leftovers() == []


def test_a_sleeping_loop_is_killed_at_the_wall_clock_limit():
    out = CodeRunner(FAST).score(ADD, "import time\nwhile True:\n    time.sleep(0.01)\n")
    assert out.reward == 0.0 and out.reason == "timeout" and _leftovers() == []


def test_a_fork_bomb_is_refused_by_the_audit_hook():
    out = CodeRunner(FAST).score(ADD, "import os\nwhile True:\n    os.fork()\n")
    assert out.reward == 0.0 and "os.fork is not allowed" in out.reason and _leftovers() == []
    # One that swallows the refusal spins until the wall-clock limit, alone.
    out = CodeRunner(FAST).score(
        ADD, "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    )
    # the wall clock (1 s) or the CPU limit (1 s of CPU), whichever comes first
    assert out.reward == 0.0 and out.reason in ("timeout", LIMIT_KILL) and _leftovers() == []


def test_a_fork_bomb_is_bounded_by_rlimit_nproc_and_killed_whole():
    """Without the hook: forks fail past RLIMIT_NPROC (the bomb counts its successes), and no process of it
    survives the run."""
    _needs("user", "nobody")
    counting = (
        "import os\nn = 0\nwhile True:\n    try:\n        if os.fork() == 0:\n            n = 0\n        else:\n"
        "            n += 1\n            print(n, flush=True)\n    except OSError:\n        pass\n"
    )
    res = run_python(counting, "", OS_ONLY)
    assert res.returncode != 0
    counts = [int(x) for x in res.stdout.split() if x.isdigit()]
    assert counts and max(counts) < OS_ONLY.processes + 8  # what nobody may hold, over every process
    assert _leftovers() == []


def test_a_process_that_leaves_the_group_dies_with_the_pid_namespace():
    _needs("processes", "pid namespace + RLIMIT_NPROC")
    escape = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\n"
    res = run_python(escape, "", OS_ONLY)
    assert res.returncode == 0
    time.sleep(0.2)
    assert _leftovers() == []


@pytest.mark.parametrize("limits", [FAST, OS_ONLY], ids=["all-guards", "os-guards"])
def test_a_flood_of_output_is_capped(limits):
    out = run_python("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n", "", limits)
    assert out.returncode != 0  # SIGXFSZ or 'File too large'
    assert len(out.stdout) <= limits.file_bytes
    assert _leftovers() == []


def test_writes_outside_the_scratch_directory_are_refused(tmp_path):
    target = Path("/tmp") / f"ttt-sandbox-escape-{os.getpid()}"
    for code in (
        f"open({str(target)!r}, 'w').write('x')",
        f"import os\nos.mkdir({str(target)!r})",
        f"import os\nos.open({str(target)!r}, os.O_CREAT | os.O_WRONLY)",
        f"import pathlib\npathlib.Path({str(target)!r}).write_text('x')",
        "open('../escape', 'w').write('x')",
    ):
        assert CodeRunner(FAST).score(ADD, code).reward == 0.0
        assert not target.exists(), code
    # Inside its scratch directory a completion may write.
    assert (
        run_python(
            "open('notes.txt', 'w').write('ok')", "assert open('notes.txt').read() == 'ok'", FAST
        ).returncode
        == 0
    )


def test_without_the_hook_the_file_system_is_read_only_to_nobody(tmp_path):
    _needs("user", "nobody")
    folder = Path("/tmp") / f"ttt-owned-by-root-{os.getpid()}"
    folder.mkdir(mode=0o755)
    try:
        res = run_python(f"open({str(folder / 'x')!r}, 'w').write('x')", "", OS_ONLY)
        assert res.returncode != 0 and "Permission denied" in res.stderr
        assert not (folder / "x").exists()
    finally:
        folder.rmdir()


@pytest.mark.parametrize("limits", [FAST, OS_ONLY], ids=["all-guards", "os-guards"])
def test_no_connection_reaches_a_listener_on_this_host(limits):
    if not limits.python_guard:
        _needs("network", "network namespace")
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(0.5)
        port = server.getsockname()[1]
        code = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\ns.sendall(b'leak')\n"
        out = CodeRunner(limits).score(ADD, code)
        assert out.reward == 0.0
        with pytest.raises(TimeoutError):
            server.accept()


def test_a_memory_hog_fails_inside_its_limit():
    out = CodeRunner(OS_ONLY).score(ADD, "x = bytearray(1 << 30)\n")
    assert out.reward == 0.0 and "MemoryError" in out.reason


def test_the_child_runs_as_nobody_when_we_are_root():
    _needs("user", "nobody")
    assert run_python(f"import os\nassert os.getuid() == {NOBODY}", "", FAST).returncode == 0
