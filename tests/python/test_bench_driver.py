"""The benchmark driver's configuration table (bench/driver.py): every row a unique name, every
reference a row of the table (the bf16 pair of an 8-bit row, the q_len-1 / default-mode base, the
plain / contiguous row), and 8-bit rows reading the bytes of their format, so that no figure the
issues' targets are read from (vs_bf16, vs_decode, vs_default, vs_plain) is silently missing.
Host-only: the rows run on the GPU (tools/gpu-bench)."""
import importlib.util
import pathlib
import sys

import pytest

_DRIVER = pathlib.Path(__file__).resolve().parents[2] / "bench" / "driver.py"
_spec = importlib.util.spec_from_file_location("bench_driver", _DRIVER)
driver = importlib.util.module_from_spec(_spec)
sys.modules["bench_driver"] = driver  # dataclasses resolve the module by name
_spec.loader.exec_module(driver)

CONFIGS = driver.all_configs()
BY_NAME = {c.name: c for c in CONFIGS}


def test_names_are_unique():
    assert len(BY_NAME) == len(CONFIGS)


@pytest.mark.parametrize("c", [c for c in CONFIGS if c.family in driver.BF16_PAIRED], ids=lambda c: c.name)
def test_8bit_rows_have_their_bf16_row(c):
    pair = BY_NAME.get(driver.bf16_pair(c))
    assert pair is not None, f"{c.name}: no bf16 row {driver.bf16_pair(c)}"
    assert pair.kv == "bf16" and (pair.B, pair.L, pair.S, pair.H, pair.Hkv, pair.D) == (c.B, c.L, c.S, c.H, c.Hkv, c.D)
    assert pair.block == c.block or not (c.op == "decode" or c.paged)


@pytest.mark.parametrize("c", [c for c in CONFIGS if c.base or c.plain], ids=lambda c: c.name)
def test_references_name_rows(c):
    for ref in (c.base, c.plain):
        if ref:
            assert ref in BY_NAME, f"{c.name}: no row {ref}"


@pytest.mark.parametrize("kv", ["fp8", "fp8e5m2"])
def test_fp8_decode_reads_half_the_bytes(kv):
    rows = [c for c in CONFIGS if c.family == "fp8_decode" and c.kv == kv]
    assert rows, f"no fp8 decode rows of {kv}"
    for c in rows:
        assert 2 * c.kv_bytes == BY_NAME[driver.bf16_pair(c)].kv_bytes, c.name
        assert f"kv={kv}" in c.spec(), c.name
