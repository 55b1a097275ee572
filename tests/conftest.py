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
    p.close(force=True)  # at the session's end: the workers have nothing to finish, and leaving gloo took up to 10 s


@pytest.fixture(scope="module", autouse=True)
def _end_module():
    """After each test module, the workers forget its fp64 references (hybrid_cp.testing.parity.end_module)."""
    yield
    for p in _STARTED:
        if not p.broken:
            p.run(parity.end_module)
