"""tests/torch's gloo helpers (dist_utils) importable here; NeMo's compiled RMSNorm eager."""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # spawned ranks inherit it
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "torch"))
sys.path.insert(0, os.path.dirname(__file__))
