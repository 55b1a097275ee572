import os

import pytest

from hybrid_cp.testing import WorkerPool

WORLD = 8


@pytest.fixture(scope="session")
def pool():
    """8 gloo ranks, started once for the whole session."""
    p = WorkerPool(WORLD, extra_paths=[os.path.dirname(__file__)])
    yield p
    p.close()
