"""``bench.json`` and ``bench-long.json`` hold numbers only; their notes files the rest."""

from __future__ import annotations

import json
import os

__all__ = ["flatten_numbers", "merge_numbers"]


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


def merge_numbers(path: str, res: dict) -> None:
    """Add ``res`` to an existing ``bench.json`` at ``path`` (its numbers, flattened) and to
    the ``.notes.json`` beside it (its strings), keeping every other key of both files: what
    a bench module run alone (``--merge``) writes, as ``hp-cp bench`` splits them."""
    numbers, notes = flatten_numbers(res)
    notes_path = os.path.splitext(path)[0] + ".notes.json"
    for target, new in ((path, numbers), (notes_path, notes)):
        old = {}
        if os.path.exists(target):
            with open(target) as f:
                old = json.load(f)
        old.update(new)
        with open(target, "w") as f:
            json.dump(old, f, indent=1, sort_keys=True)
