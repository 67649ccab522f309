"""``hp-cp bench --megatron`` (``hp_cp_torch.bench.megatron``) end to end at one tiny cell (the
``quick`` grid: 4 heads, S = 128, top-k 32, cp 2, about 30 s on 2 cores): every side runs, the
keys of the cell and the headline are written, and the bytes are what the side by side states
(hp_cp 0.75 of Megatron's all-gather at cp 2; the same-kernel all-gather equals Megatron's to
the byte). The grid itself is run by hand (docs/megatron.md): its timings need a quiet machine.

Skipped when megatron-core is absent, unless ``HP_CP_REQUIRE_BACKEND`` contains ``megatron``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

if "megatron" in os.environ.get("HP_CP_REQUIRE_BACKEND", ""):
    import megatron.core  # noqa: F401 - must be importable: fail, not skip
else:
    pytest.importorskip("megatron.core", exc_type=ImportError)

from hp_cp_core import HpCpError  # noqa: E402
from hp_cp_torch.bench.megatron import GRID, QUICK, Cell, parse_cells  # noqa: E402


def test_the_grid_spans_the_shapes_asked_for() -> None:
    assert len(GRID) == 24
    assert {c.heads for c in GRID} == {8, 32, 64}
    assert {c.seq for c in GRID} == {2048, 4096}
    assert {c.seq // c.topk for c in GRID} == {8, 2}
    assert {c.cp for c in GRID} == {2, 4}
    assert parse_cells("grid") == GRID and parse_cells("quick") == QUICK
    assert parse_cells("8:2048:256:2,64:4096:2048:4") == (
        Cell(8, 2048, 256, 2),
        Cell(64, 4096, 2048, 4),
    )
    for bad in ("8:2048:256", "8:2048:4096:2", "8:2049:256:2", "", "a:b:c:d"):
        with pytest.raises(HpCpError, match="--megatron-cells"):
            parse_cells(bad)


@pytest.mark.slow
def test_the_quick_cell_runs_every_side(tmp_path) -> None:
    out = tmp_path / "bench-megatron.json"
    cmd = [sys.executable, "-m", "hp_cp_torch.bench", "--megatron", "--megatron-cells", "quick"]
    done = subprocess.run(
        [*cmd, "--megatron-out", str(out)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-4000:]
    res = json.loads(out.read_text())
    key = f"megatron_{QUICK[0].name}"
    for side in ("megatron", "hp_cp", "allgather"):
        for measure in ("step_s", "peak_bytes", "bytes_recv"):
            assert res[f"{key}_{side}_{measure}"] > 0, (side, measure)
    assert res[f"{key}_bytes_ratio"] == 0.75
    assert res[f"{key}_allgather_bytes_recv"] == res[f"{key}_megatron_bytes_recv"]
    for measure in ("bytes", "step_time", "peak_mem"):
        assert res[f"megatron_worst_{measure}_ratio_cell"] == QUICK[0].name
        assert res[f"megatron_worst_{measure}_vs_allgather_ratio"] > 0
    assert res["megatron_skipped_cells"] == [] and res["megatron_bench_wall_s"] > 0
    assert res["megatron_megatron_over_24gib_cells"] == []
