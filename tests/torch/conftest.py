"""Without a GPU, Triton kernels run in Triton's interpreter (``TRITON_INTERPRET=1``). Triton
reads the variable when a kernel is defined, including its own ``triton.language`` helpers
at ``import triton``, so it is set here, before any test module (or torch._dynamo) can import
Triton; spawned ranks inherit it.

The collected test modules are handed to ``cases.collected``: the suites of those modules
share one spawned job per world size (``cases.JOINT_SUITES``)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_finish(session: pytest.Session) -> None:
    import cases  # after TRITON_INTERPRET is set

    # the items left after -k / -m deselection
    cases.collected({item.path.name for item in session.items})
