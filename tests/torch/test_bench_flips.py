"""``hp_cp_torch.bench.flips``' counting (Note [Counting a flip]) on hand-made choice logs:
the bench itself is opt-in and out of CI."""

from __future__ import annotations

import torch

from hp_cp_torch.bench.flips import ChoiceLog, compare_logs, markdown_table, summarise


def _log(entries: list[tuple[str, str, torch.Tensor, torch.Tensor | None]]) -> ChoiceLog:
    log = ChoiceLog()
    for layer, kind, value, rows in entries:
        log.layer = layer
        log.add(kind, value, rows)
    return log


def test_flips_counted_per_site_over_ranks() -> None:
    kv = torch.arange(12.0).reshape(1, 6, 2)
    picks = torch.tensor([[[0, 1], [1, 2], [-1, 0], [2, 3], [0, 3], [1, -1]]])
    slots = torch.ones(1, 3, 2)
    ref = _log([("L0", "fp8", kv, torch.arange(6)), ("L0", "nvfp4", slots, None),
                ("L1", "topk", picks, torch.arange(6))])  # fmt: skip
    kv_cp, picks_cp = kv.clone(), picks.clone()
    kv_cp[0, 4, 1] += 0.5  # one flipped quantized element (rank 1's row 4)
    picks_cp[0, 3] = torch.tensor([3, 1])  # one pick of row 3 moved: 2 -> 1
    slots_cp = slots.clone()
    slots_cp[0, 1, 0] = 2.0  # rank 1's buffer: slot 1 channel 0 flipped
    rows0, rows1 = torch.tensor([0, 1, 2]), torch.tensor([3, 4, 5, 6])  # row 6: padding
    pad = torch.zeros(1, 1, 2)
    rank0 = _log([("L0", "fp8", kv_cp[:, :3], rows0), ("L0", "nvfp4", slots[:, :2], None),
                  ("L1", "topk", picks_cp[:, :3], rows0)])  # fmt: skip
    rank1 = _log([("L0", "fp8", torch.cat([kv_cp[:, 3:], pad], 1), rows1),
                  ("L0", "nvfp4", slots_cp, None),
                  ("L1", "topk", torch.cat([picks_cp[:, 3:], pad.long()], 1), rows1)])  # fmt: skip
    sites = compare_logs(ref, [rank0, rank1])
    assert list(sites) == ["L0.fp8", "L0.nvfp4", "L1.topk"]  # forward order
    assert sites["L0.fp8"] == ["fp8", 1, 12]
    assert sites["L0.nvfp4"] == ["nvfp4", 1, 6]
    assert sites["L1.topk"] == ["topk", 1, 10]  # 10 real picks, one moved


def test_summary_names_the_first_flip_and_its_cost() -> None:
    def run(seed: int, sites: dict, logits: float) -> dict:
        return {"model": "m", "dtype": "fp32", "cp": 1, "seed": seed, "sites": sites,
                "logits": logits, "loss": logits / 10, "grads": logits * 2}  # fmt: skip

    quiet = {"L0.fp8": ["fp8", 0, 10], "L1.topk": ["topk", 0, 8]}
    cascade = {"L0.fp8": ["fp8", 1, 10], "L1.topk": ["topk", 2, 8]}
    res = summarise([run(0, quiet, 1e-7), run(1, cascade, 0.1), run(2, quiet, 3e-7)])
    assert res["flips_m_fp32_runs"] == 3
    assert res["flips_m_fp8_fp32_rate"] == 1 / 3
    assert res["flips_m_fp8_fp32_first_rate"] == 1 / 3
    assert res["flips_m_topk_fp32_first_rate"] == 0.0  # a consequence, not the cause
    assert res["flips_m_fp8_fp32_cost_logits"] == 0.1
    assert res["flips_m_picks_moved_fp32_rate"] == 1 / 3
    assert res["flips_m_none_fp32_rate"] == 2 / 3
    assert res["flips_m_none_fp32_cost_logits"] == 2e-7
    assert "| m fp32 (3) | fp8 |" in markdown_table(res)
