"""``python -m hp_cp_core`` (and ``--json``): the core version, the active discovery switches,
and per backend name, distribution, version, ok / error."""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import subprocess
import sys

import pytest

from hp_cp_core import __main__ as cli
from hp_cp_core import __version__


def run_cli(*args: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("HP_CP_")}
    out = subprocess.run(
        [sys.executable, "-m", "hp_cp_core", *args],
        env={**clean, **env},
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return out.stdout


FAKE_ROW = {
    "name": "fake",
    "dist": "hp-cp-fake",
    "version": "0.4.0",
    "status": "ok",
    "error": None,
    "backend_api": "0.2",
    "api_status": "current",
}


def test_json_lists_the_installed_fake() -> None:
    got = json.loads(run_cli("--json", HP_CP_PLUGINS="fake"))
    assert got == {
        "core": __version__,
        "switches": {"HP_CP_PLUGINS": "fake"},
        "backends": [FAKE_ROW],
    }
    got = json.loads(run_cli("--json"))  # with every installed backend
    assert FAKE_ROW in got["backends"] and got["switches"] == {}


def test_table_lists_the_installed_fake() -> None:
    lines = run_cli(HP_CP_PLUGINS="fake").splitlines()
    assert lines[0] == f"hp-cp-core {__version__}; discovery switches: HP_CP_PLUGINS=fake"
    assert lines[1].split() == ["backend", "distribution", "version", "api", "status"]
    assert lines[2].split() == ["fake", "hp-cp-fake", "0.4.0", "0.2", "current", "ok"]
    assert len(lines) == 3


def test_disabled_autoload_lists_nothing() -> None:
    """HP_CP_DISABLE_PLUGIN_AUTOLOAD=1 turns discovery off here too (the allow-list still loads)."""
    lines = run_cli(HP_CP_DISABLE_PLUGIN_AUTOLOAD="1").splitlines()
    assert lines == [
        f"hp-cp-core {__version__}; discovery switches: HP_CP_DISABLE_PLUGIN_AUTOLOAD=1",
        "no hp_cp backends loaded: the switches above turned discovery off",
    ]
    got = json.loads(run_cli("--json", HP_CP_DISABLE_PLUGIN_AUTOLOAD="1", HP_CP_PLUGINS="fake"))
    assert got["backends"] == [FAKE_ROW]


def test_broken_backends_are_listed_with_their_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    real = md.entry_points
    broken = md.EntryPoint(name="broken", value="hp_cp_fake.broken_import", group="hp_cp")

    def entry_points(**kwargs):
        eps = list(real(**kwargs))
        return [*eps, broken] if kwargs.get("group") == "hp_cp" else eps

    monkeypatch.setattr(md, "entry_points", entry_points)
    monkeypatch.setenv("HP_CP_PLUGINS", "fake,broken")
    assert cli.main(["--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["backends"]
    assert rows == [
        FAKE_ROW,
        {
            "name": "broken",
            "dist": None,
            "version": None,
            "status": "error",
            "error": "ModuleNotFoundError: No module named 'hp_cp_framework_that_does_not_exist'",
            "backend_api": None,
            "api_status": None,
        },
    ]
    assert cli.main([]) == 0
    table = capsys.readouterr().out.splitlines()[1:]
    assert table[1].split() == ["fake", "hp-cp-fake", "0.4.0", "0.2", "current", "ok"]
    assert table[2].split()[:5] == ["broken", "-", "-", "-", "error:"]
    assert table[2].endswith("No module named 'hp_cp_framework_that_does_not_exist'")


def test_nothing_installed(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setenv("HP_CP_PLUGINS", "")
    assert cli.main([]) == 0
    assert capsys.readouterr().out.splitlines()[1] == (
        "no hp_cp backends loaded: the switches above turned discovery off"
    )
    assert cli.main(["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["backends"] == []


def test_nothing_installed_points_to_the_backends_and_the_guide(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setattr(md, "entry_points", lambda **kwargs: [])
    assert cli.main([]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith("no hp_cp backends installed; try `pip install hp-cp-torch`")
    assert "docs/writing-a-backend.md" in out[1]
