"""pytest setup for the Python package's tests.

Where flashserve comes from: an installed package (pip install .), or a CMake build's
package directory named by FLASHSERVE_PYTHONPATH (e.g. build/cpu-python/python), which is put
first on sys.path. Seeds: FLASHSERVE_SEED fixes the base seed (else a fresh one per run); the
`rng` fixture derives one numpy Generator per test from it and the test id, and a failing test
reports the seed to set."""

from __future__ import annotations

import os
import random
import sys
import zlib

import numpy as np
import pytest

_PATH = os.environ.get("FLASHSERVE_PYTHONPATH")
if _PATH:
    sys.path.insert(0, os.path.abspath(_PATH))
sys.path.insert(0, os.path.dirname(__file__))  # the tests' shared helpers

BASE_SEED = int(os.environ.get("FLASHSERVE_SEED") or random.SystemRandom().randrange(1 << 31))
os.environ.setdefault("FLASHSERVE_SEED", str(BASE_SEED))  # one seed for every helper of the run


def pytest_report_header(config: pytest.Config) -> str:
    import flashserve
    return (f"flashserve {flashserve.__version__} from {os.path.dirname(flashserve.__file__)} "
            f"(CUDA kernels: {flashserve.WITH_CUDA}); FLASHSERVE_SEED={BASE_SEED}")


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> np.random.Generator:
    """A numpy Generator seeded from FLASHSERVE_SEED and the test id."""
    seed = (BASE_SEED + zlib.crc32(request.node.nodeid.encode())) % (1 << 31)
    request.node.flashserve_seed = seed
    return np.random.default_rng(seed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    seed = getattr(item, "flashserve_seed", None)
    if report.failed and seed is not None:
        report.sections.append(("flashserve seed", f"FLASHSERVE_SEED={BASE_SEED} (test seed {seed})"))
