"""The main job: `hp-cp demo` (reference stack and the transformers model) passes parity."""

from __future__ import annotations

import pytest

from hp_cp_torch.cli import main


def test_demo_reference_cp2(capsys):
    assert main(["demo", "--cp", "2", "--layout", "load_balanced"]) == 0
    out = capsys.readouterr().out
    assert "PARITY OK" in out and "bytes sent" in out


def test_demo_transformers_cp2(capsys):
    pytest.importorskip("transformers")
    assert main(["demo", "--cp", "2", "--model", "transformers"]) == 0
    out = capsys.readouterr().out
    assert "PARITY OK" in out and "compressed_sparse_attention" in out


def test_demo_rejects_bad_cp():
    with pytest.raises(SystemExit):
        main(["demo", "--cp", "0"])
