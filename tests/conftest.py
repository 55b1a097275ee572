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
def _end_module():
    """After each test module, the workers forget its fp64 references (hybrid_cp.testing.parity.end_module)."""
    yield
    for p in _STARTED:
        if not p.broken:
            p.run(parity.end_module)
