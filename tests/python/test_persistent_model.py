"""The persistent prefill kernels' synchronization model (tools/model_persistent.py: mbarrier
phases, the ping-pong's named barriers, the item hand-over, Q reloads and the K / V stages
across items) over random walks and interleavings: no deadlock, no buffer overwritten before
its readers released it. Host-only; the kernels themselves are tested on the GPU
(tests/gpu/test_gpu_prefill*.cpp, ctest prefix persistent.)."""
import importlib.util
import pathlib
import random

import pytest

_TOOL = pathlib.Path(__file__).resolve().parents[2] / "tools" / "model_persistent.py"
_spec = importlib.util.spec_from_file_location("model_persistent", _TOOL)
model_persistent = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(model_persistent)


@pytest.mark.parametrize("wgs,k_ahead,fp8,split", [(2, True, False, False), (2, False, False, False),
                                                   (3, True, False, False), (2, True, True, False),
                                                   (2, True, False, True), (2, True, True, True)])
def test_walks_neither_deadlock_nor_race(wgs, k_ahead, fp8, split, rng):
    rng = random.Random(int(rng.integers(1 << 62)))  # the run's seed (conftest: FLASHSERVE_SEED)
    for _ in range(300):
        items = [(rng.random() > 0.2, rng.choice([0, 1, 1, 2, 3, 4, 5])) for _ in range(rng.randint(1, 9))]
        assert model_persistent.model(items, wgs, k_ahead, fp8, rng, split) is None, items


def test_model_finds_a_missing_release(rng):
    # The bug the model found before any GPU run: the last V stage of an item never released
    # (one-item kernels need not release it; a walk does). Without the release, walks deadlock.
    src = _TOOL.read_text()
    fixed = ('                yield lambda: True\n'
             '                release(f"{vname}_empty{st(T - 1)}", f"{vname}{st(T - 1)}")')
    assert fixed in src
    broken = src.replace(fixed, '                yield lambda: True')
    ns = {"__name__": "model_broken"}
    exec(compile(broken, "model_broken", "exec"), ns)
    rng = random.Random(int(rng.integers(1 << 62)))
    results = [ns["model"]([(True, 1)] * 6, 2, True, False, rng) for _ in range(20)]
    assert "deadlock" in results
