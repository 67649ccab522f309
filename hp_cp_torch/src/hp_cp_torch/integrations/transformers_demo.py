"""Deprecated path of :mod:`hp_cp_torch.cli.parity` (the tiny HF parity harness): each name
read here warns and is the same object as there; removed in 0.4.0."""

from __future__ import annotations

from typing import Any

from hp_cp_torch.cli import parity
from hp_cp_torch.deprecation import warn_deprecated


def __getattr__(name: str) -> Any:
    value = getattr(parity, name)
    warn_deprecated(
        f"hp_cp_torch.integrations.transformers_demo.{name}", f"hp_cp_torch.cli.parity.{name}"
    )
    return value
