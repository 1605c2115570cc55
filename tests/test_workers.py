"""The ordered worker map behind `ttt data prepare`: order, errors and stopping never hang."""

import os
import signal
import time

import pytest

from timetotrain.data.workers import OrderedWorkers, WorkerError


def slow_square(x: int) -> int:
    time.sleep(0.02 * (x % 3))  # uneven job times: results finish out of order
    return x * x


def fail_on_five(x: int) -> int:
    if x == 5:
        raise ValueError("five")
    return x


def die_on_three(x: int) -> int:
    if x == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    return x


def big(x: int) -> bytes:
    return bytes(1 << 20)  # larger than a pipe buffer, both ways


@pytest.mark.parametrize("n", [1, 2, 3])
def test_results_in_job_order(n):
    with OrderedWorkers(n, slow_square) as w:
        assert list(w.map(range(10))) == [x * x for x in range(10)]


def test_fewer_jobs_than_workers_and_none():
    with OrderedWorkers(4, slow_square) as w:
        assert list(w.map([2])) == [4]
        assert list(w.map([])) == []


def test_large_jobs_and_results_do_not_deadlock():
    with OrderedWorkers(2, big) as w:
        assert sum(len(r) for r in w.map(bytes(1 << 20) for _ in range(6))) == 6 << 20


def test_a_worker_exception_is_raised_in_the_parent():
    with pytest.raises(WorkerError, match="ValueError.*five"), OrderedWorkers(2, fail_on_five) as w:
        list(w.map(range(10)))


def test_a_dead_worker_is_an_error_not_a_hang():
    with pytest.raises(WorkerError, match="died"), OrderedWorkers(2, die_on_three) as w:
        list(w.map(range(10)))


def test_leaving_early_kills_the_workers():
    with pytest.raises(KeyboardInterrupt), OrderedWorkers(2, slow_square) as w:
        pids = w.pids
        for r in w.map(range(1000)):
            if r > 10:
                raise KeyboardInterrupt
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
