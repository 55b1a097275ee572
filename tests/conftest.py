import os

import pytest

from hybrid_cp.testing import WorkerPool, parity

WORLD = 8


_STARTED: list[WorkerPool] = []


@pytest.fixture(scope="session")
def pool():
    """8 gloo ranks, started once for the whole session."""
    p = WorkerPool(WORLD, extra_paths=[os.path.dirname(__file__)])
    _STARTED.append(p)
    yield p
    p.close()


@pytest.fixture(scope="module", autouse=True)
def _release_meshes():
    """After each test module, the pool's cached meshes are destroyed: idle gloo groups cost CPU (three threads
    each), and a module rarely reuses another's meshes (hybrid_cp.testing.parity.release_meshes)."""
    yield
    for p in _STARTED:
        if not p.broken:
            p.run(parity.release_meshes)
