"""The test pools' own behaviour: a paused pool's workers are stopped until its next task."""

import os
import signal
import time

import pytest

import hybrid_cp.testing.parity as parity


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]  # after the command name, which may hold spaces


def _states(pool, wait: float = 0.0) -> set[str]:
    """The workers' process states, after at most `wait` seconds for them all to be stopped (a signal arrives
    asynchronously)."""
    deadline = time.monotonic() + wait
    while {_state(p.pid) for p in pool.procs} != {"T"} and time.monotonic() < deadline:
        time.sleep(0.01)
    return {_state(p.pid) for p in pool.procs}


@pytest.mark.skipif(not (hasattr(signal, "SIGSTOP") and os.path.isdir("/proc/self")), reason="needs SIGSTOP, /proc")
def test_paused_pool_is_stopped_until_its_next_task(pool):
    pool.run(parity.end_module)
    pool.pause()
    assert pool.paused and _states(pool, wait=10) == {"T"}
    pool.pause()  # twice: still one pause
    assert pool.run(parity.end_module) == [0] * pool.world
    assert not pool.paused and "T" not in _states(pool)
