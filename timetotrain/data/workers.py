"""Ordered map over worker processes that can always be stopped.

`multiprocessing.Pool` shares one result pipe between all workers and reads it from a helper thread, so a
worker stopped in the middle of writing a result leaves a partial message there, and `Pool.terminate()`
then waits forever for the rest of it (seen under load when `ttt data prepare` was interrupted). Here each
worker has its own duplex pipe, there are no helper threads and no locks shared with the workers, so
stopping is: kill the processes, join them, close the pipes.

Each worker has at most one job in flight, and the parent prepares the next job while the workers compute.
With one job in flight a worker is always reading when the parent sends to it, so large jobs and large
results cannot fill both directions of a pipe at once and deadlock.

A worker never outlives the parent: on Linux it gets SIGKILL when the parent dies (lifeline.py), and
everywhere its pipe reaches end of file then, because a forked worker closes the parent's ends of every
pipe it inherited (holding its own pipe's other end kept it alive after a `kill -9` of the parent).
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import signal
import traceback
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from timetotrain import lifeline


def _context():
    return mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")


def _serve(conn, fn, init, initargs, parent_pid, parent_ends) -> None:
    # Ctrl-C reaches the whole process group; only the parent reacts (it stops us).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    lifeline.die_with_parent(parent_pid, signal.SIGKILL)  # a job in flight is not worth finishing
    for c in parent_ends:  # under fork we hold copies; only the parent's may keep our pipe open
        c.close()
    try:
        if init is not None:
            init(*initargs)
        while (job := conn.recv()) is not None:
            conn.send((True, fn(job)))
    except EOFError:  # the parent went away
        return
    except BaseException as e:  # sent back, raised in the parent
        try:
            conn.send((False, (repr(e), traceback.format_exc())))
        except (OSError, EOFError):
            pass


_DONE = object()


class WorkerError(RuntimeError):
    pass


class OrderedWorkers:
    """`with OrderedWorkers(n, fn, init, initargs) as w: for r in w.map(jobs): ...` yields fn(job) in job
    order. Leaving the block on an exception (or a signal raised as one) kills the workers at once."""

    def __init__(self, n: int, fn: Callable, init: Callable | None = None, initargs: tuple = ()):
        ctx = _context()
        self._procs, self._conns = [], []
        fork = ctx.get_start_method() == "fork"
        for _ in range(max(1, n)):
            parent, child = ctx.Pipe(duplex=True)
            # Under spawn nothing is inherited, and connections cannot be sent along: nothing to close.
            ends = [*self._conns, parent] if fork else []
            args = (child, fn, init, initargs, os.getpid(), ends)
            p = ctx.Process(target=_serve, args=args, daemon=True)
            p.start()
            child.close()
            self._procs.append(p)
            self._conns.append(parent)

    def __enter__(self) -> OrderedWorkers:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            for c in self._conns:
                try:
                    c.send(None)
                except OSError:
                    pass
            for p in self._procs:
                p.join(timeout=30)
        self.stop()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def stop(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join()
        for c in self._conns:
            c.close()

    def _recv(self, w: int) -> Any:
        try:
            ok, value = self._conns[w].recv()
        except EOFError:
            code = self._procs[w].exitcode
            raise WorkerError(f"worker process {self._procs[w].pid} died (exit code {code})") from None
        if not ok:
            what, tb = value
            raise WorkerError(f"worker process failed: {what}\n{tb}")
        return value

    def map(self, jobs: Iterable) -> Iterator:
        n = len(self._conns)
        jobs = iter(jobs)
        # Prime every worker with one job; job k goes to worker k % n.
        in_flight = 0
        for w, job in zip(range(n), jobs, strict=False):  # range first: no job is dropped
            self._conns[w].send(job)
            in_flight += 1
        for k in itertools.count():
            if in_flight == 0:
                return
            w = k % n
            nxt = next(jobs, _DONE)  # read while the workers compute
            result = self._recv(w)
            in_flight -= 1
            if nxt is not _DONE:
                self._conns[w].send(nxt)
                in_flight += 1
            yield result
