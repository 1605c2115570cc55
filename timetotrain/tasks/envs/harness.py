"""The test harness that runs inside the code sandbox (read as text by sandbox.py, run there with
`python -I -S -B -c`; nothing imports it). Standard library only: the sandbox holds no site-packages.

argv: the job's fd (a memfd: JSON with the completion, the tests, the run's nonce, its rlimits and the
no-exec seccomp program) and the verdict's fd (a pipe to the parent). Order matters:
1. read the job and close its fd, so the completion cannot reread the nonce;
2. set the rlimits (hard = soft but for CPU time: nothing in the sandbox may raise a hard limit);
3. load the no-exec filter (bwrap loaded the main one before starting us; from here no execve);
4. run the completion, then the tests, in one namespace, catching everything they raise (SystemExit too);
5. in the harness's own process only (not in one the completion forked), flush stdout and stderr, write one
   line, `<nonce> pass` or `<nonce> fail <reason>`, to the verdict fd, and leave with `os._exit`, so that no
   atexit handler, finally block or thread of the completion runs after the verdict.
The exit code means nothing: an early `os._exit(0)`, a kill or a crash leaves no line, which scores 0.
What a completion in this process can still do: read this harness's frames (sys._getframe, gc) to find the
nonce and the fd, and write a passing line itself. Everything the harness needs after the completion ran
is bound before it runs, so that monkeypatching a module (os.write, json) gains it nothing.
"""

import ctypes
import json
import os
import resource
import sys

_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 22, 2


class _Fprog(ctypes.Structure):  # struct sock_fprog
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _limit(limits: dict[str, int]) -> None:
    for name, value in limits.items():
        # CPU: SIGXCPU at the soft limit names the cause; the hard one, a second later, is SIGKILL
        hard = value + 1 if name == "RLIMIT_CPU" else value
        resource.setrlimit(getattr(resource, name), (value, hard))


def _forbid_exec(program: bytes) -> None:
    buf = ctypes.create_string_buffer(program, len(program))
    fprog = _Fprog(len(program) // 8, ctypes.addressof(buf))
    libc = ctypes.CDLL(None, use_errno=True)
    ulong = ctypes.c_ulong
    if libc.prctl(_PR_SET_SECCOMP, ulong(_SECCOMP_MODE_FILTER), ctypes.byref(fprog), ulong(0), ulong(0)):
        raise OSError(ctypes.get_errno(), "seccomp: the no-exec filter did not load")


def _describe(e: BaseException) -> str:
    """`Type: message`, never raising (a completion's exception may have a hostile __str__)."""
    try:
        text = str(e)
    except BaseException:  # noqa: B036 - anything a completion's __str__ raises
        text = "?"
    name = type(e).__name__
    return f"{name}: {text}" if text else name


def _run(solution: str, tests: str, describe=_describe) -> str:
    """'' when the completion and then the tests ran to the end, else why not. `describe` is bound here, not
    looked up: the completion may have emptied this module's globals by then."""
    scope = {"__name__": "__main__"}
    for filename, source in (("solution.py", solution), ("tests.py", tests)):
        try:
            exec(compile(source, filename, "exec"), scope)
        except BaseException as e:  # noqa: B036 - SystemExit and KeyboardInterrupt are failures too
            return f"{filename}: {describe(e)}"
    return ""


def main() -> None:
    job_fd, verdict_fd = int(sys.argv[1]), int(sys.argv[2])
    with os.fdopen(job_fd, "rb") as f:
        job = json.loads(f.read())
    _limit(job["limits"])
    _forbid_exec(bytes.fromhex(job["no_exec"]))
    head = job.pop("nonce").encode() + b" "
    write, leave, pid, me = os.write, os._exit, os.getpid, os.getpid()
    flushes = [(type(s).flush, s) for s in (sys.stdout, sys.stderr)]
    why = _run(job.pop("solution"), job.pop("tests"))
    if pid() != me:  # a process the completion forked got here: only the harness's own process speaks
        leave(0)
    for flush, stream in flushes:  # what the completion printed (its own flush methods are not called)
        try:
            flush(stream)
        except BaseException:  # noqa: B036 - a closed or broken stream loses output, not the verdict
            pass
    line = head + (b"pass" if not why else b"fail " + why.replace("\n", " ")[:300].encode("utf-8", "replace"))
    write(verdict_fd, line + b"\n")
    leave(0)


if __name__ == "__main__":
    main()
