import os
import shutil
import tempfile

import pytest

from hybrid_cp.testing import WorkerPool, parity

HERE = os.path.dirname(__file__)
# What most workers import beside torch and hybrid_cp: imported once by their fork server, not by each worker.
PRELOAD = ("hybrid_cp.testing.parity", "transformers.modeling_utils", "transformers.models.llama.modeling_llama")
# Two pools: 4 ranks for meshes of up to 4 ranks, 8 for the 8-rank meshes. On a 2-core machine the parity runs of
# six meshes of up to 4 ranks took 19.0 s on 4 ranks against 21.4 s on 8 (two replicas of each mesh side by side),
# 34 against 41 CPU seconds (benchmarks/pool_size.py).
SMALL, LARGE = 4, 8
_POOLS: dict[int, WorkerPool] = {}
# The fp64 references either pool computes, kept for the other (the workers inherit the variable).
os.environ[parity.CACHE_ENV] = tempfile.mkdtemp(prefix="hybrid-cp-parity-")


def _pool(world: int) -> WorkerPool:
    """The session's pool of `world` ranks, started on first use and kept to the session's end."""
    if world not in _POOLS:
        _POOLS[world] = WorkerPool(world, extra_paths=[HERE], preload=PRELOAD)
    return _POOLS[world]


@pytest.fixture(scope="session", autouse=True)
def _close_pools():
    yield
    for p in _POOLS.values():  # the workers have nothing to finish, and leaving gloo took up to 10 s
        p.close(force=True)
    shutil.rmtree(os.environ[parity.CACHE_ENV], ignore_errors=True)


@pytest.fixture
def pool(request) -> WorkerPool:
    """The smallest session pool that holds the test's mesh: its parameters `u` and `r` (1 if absent) or `mesh`
    ((u, r)); 4 ranks for a test without them. A test whose task builds an 8-rank mesh itself takes `pool8`, and so
    does a hypothesis test (this fixture is per test function, which hypothesis refuses)."""
    params = request.node.callspec.params if hasattr(request.node, "callspec") else {}
    u, r = params.get("mesh", (params.get("u", 1), params.get("r", 1)))
    return _pool(SMALL if u * r <= SMALL else LARGE)


@pytest.fixture(scope="session")
def pool8() -> WorkerPool:
    """The session's 8 gloo ranks (started on first use)."""
    return _pool(LARGE)


def _pause_pools() -> None:
    for p in _POOLS.values():
        p.pause()


@pytest.fixture(autouse=True)
def _pause_after_test():
    """After each test, the session pools are paused (SIGSTOP) until their next task: the pool not in use (and
    both during the tests that run in this process) would otherwise keep waking its gloo groups' threads."""
    yield
    _pause_pools()


@pytest.fixture(scope="module", autouse=True)
def _end_module():
    """After each test module, the workers forget its fp64 references (hybrid_cp.testing.parity.end_module)."""
    yield
    for p in _POOLS.values():
        if not p.broken:
            p.run(parity.end_module)
    _pause_pools()
