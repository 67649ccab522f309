"""A missing MindSpore, or a missing mindformers package, fails the mindformers tests when
``HP_CP_REQUIRE_BACKEND`` names ``mindformers`` (the nox session), and skips them otherwise.
MindSpore is hidden from a child pytest with ``sys.modules["mindspore"] = None``, mindformers by
making ``importlib.util.find_spec`` not find it; this module itself needs no MindSpore."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
RUN = (
    "import sys; sys.modules['mindspore'] = None; import pytest; "
    "sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '--collect-only', sys.argv[1]]))"
)


@pytest.mark.parametrize("required", [True, False], ids=["required", "optional"])
def test_missing_mindspore(required: bool) -> None:
    env = {k: v for k, v in os.environ.items() if k != "HP_CP_REQUIRE_BACKEND"}
    if required:
        env["HP_CP_REQUIRE_BACKEND"] = "fake,mindformers"
    target = os.path.join(HERE, "test_mindformers_inprocess.py")
    out = subprocess.run(
        [sys.executable, "-c", RUN, target],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=HERE,
    )
    text = out.stdout + out.stderr
    if required:
        assert out.returncode != 0, text
        assert "HP_CP_REQUIRE_BACKEND asks for the mindformers backend" in text, text
    else:
        assert out.returncode in (0, 5), text  # 5: nothing collected (module skipped)
        assert "MindSpore cannot be imported" in text or "skipped" in text, text


HIDE_MINDFORMERS = (
    "import importlib.util, sys; find = importlib.util.find_spec; "
    "importlib.util.find_spec = lambda n, *a: None if n.split('.')[0] == 'mindformers' "
    "else find(n, *a); import pytest; "
    "sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', *sys.argv[1:]]))"
)


@pytest.mark.parametrize("required", [True, False], ids=["required", "optional"])
def test_missing_mindformers(required: bool) -> None:
    """The real-cell tests (in-process check and the msrun job) need the mindformers package."""
    pytest.importorskip("mindspore")
    env = {k: v for k, v in os.environ.items() if k != "HP_CP_REQUIRE_BACKEND"}
    if required:
        env["HP_CP_REQUIRE_BACKEND"] = "fake,mindformers"
    targets = [
        os.path.join(HERE, "test_real_mindformers.py") + "::test_adapter_maps_a_real_instance",
        os.path.join(HERE, "test_real_mindformers_msrun.py")
        + "::test_all_gather_into_tensor_standin_matches_its_formula",
    ]
    out = subprocess.run(
        [sys.executable, "-c", HIDE_MINDFORMERS, *targets],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=HERE,
    )
    text = out.stdout + out.stderr
    if required:
        assert out.returncode == 1, text
        assert text.count("HP_CP_REQUIRE_BACKEND asks for the mindformers backend") >= 2, text
        assert "4 errors" in text, text  # the fixtures fail: 3 parametrized cases + 1
    else:
        assert out.returncode == 0, text
        assert "skipped" in text and "failed" not in text, text
