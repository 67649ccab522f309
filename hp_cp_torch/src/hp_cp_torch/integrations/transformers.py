"""Hugging Face transformers ``DeepseekV4Attention`` under CP (work in progress)."""

from __future__ import annotations

from typing import Any


def hf_adapter_for(module: Any) -> Any:
    """The adapter for a transformers DeepSeek V4 attention module, else ``None``."""
    return None
