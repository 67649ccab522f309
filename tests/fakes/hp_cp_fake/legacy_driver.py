"""The contract driver of the 0.1-API backend (entry point ``hp_cp.contract: legacy``):
the fake's driver on :mod:`hp_cp_fake.legacy_backend`, so the installed contract suite runs a
0.1 backend through the core's adaptation."""

from __future__ import annotations

from typing import Any

from hp_cp_fake.contract_driver import FakeDriver


class LegacyDriver(FakeDriver):
    name = "legacy"

    def plugin(self) -> tuple[str, Any, type]:
        from hp_cp_fake import legacy_backend as lb

        return "legacy", lb, lb.LegacyToyAttention
