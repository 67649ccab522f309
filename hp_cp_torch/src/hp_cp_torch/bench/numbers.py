"""``bench.json`` and ``bench-long.json`` hold numbers only; their notes files the rest."""

from __future__ import annotations

__all__ = ["flatten_numbers"]


def flatten_numbers(res: dict) -> tuple[dict, dict]:
    """``bench.json`` holds numbers only (per-rank lists become ``key_<i>``); the strings that
    name a setup go to ``bench.notes.json``."""
    numbers: dict = {}
    notes: dict = {}
    for key, value in res.items():
        if isinstance(value, bool):
            numbers[key] = int(value)
        elif isinstance(value, (int, float)):
            numbers[key] = value
        elif isinstance(value, (list, tuple)) and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in value
        ):
            numbers.update({f"{key}_{i}": v for i, v in enumerate(value)})
        else:
            notes[key] = value
    return numbers, notes
