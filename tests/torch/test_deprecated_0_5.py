"""What hp_cp 0.5.0 deprecates (one name per concept, issue 57): each old name still works
as before, with a ``DeprecationWarning`` naming its replacement and the release (0.6.0) that
removes it."""

from __future__ import annotations

import importlib
import warnings

import pytest
import torch

from hp_cp_torch.adapter import adapter_for


@pytest.mark.parametrize(
    ("module", "name"),
    [("transformers_dsa", "dsa_adapter_for"), ("nemo_automodel_v41", "nemo_v41_adapter_for")],
)
def test_the_per_model_adapter_lookups_warn_naming_the_registry(module: str, name: str) -> None:
    lookup = getattr(importlib.import_module(f"hp_cp_torch.integrations.{module}"), name)
    with pytest.warns(DeprecationWarning) as got:
        assert lookup(torch.nn.Linear(2, 2)) is None  # as before: not its layer
    (warning,) = got
    text = str(warning.message)
    assert f"hp_cp_torch.integrations.{module}.{name} is deprecated since hp_cp 0.5.0" in text
    assert "removed in 0.6.0" in text
    assert "hp_cp_torch.adapter.adapter_for(module)" in text
    assert "register_model_adapter" in text
    assert warning.filename == __file__  # points at the caller
    assert adapter_for(torch.nn.Linear(2, 2)) is None  # the replacement, silent


def test_is_v41_model_does_not_warn() -> None:
    from hp_cp_torch.integrations.nemo_automodel_v41 import is_v41_model

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not is_v41_model(torch.nn.Linear(2, 2))


def test_the_torch_cpforward_is_installed_forward_under_its_old_name() -> None:
    import hp_cp_core
    import hp_cp_torch.adapter as torch_adapter

    with pytest.warns(DeprecationWarning, match=r"CPForward is deprecated.*InstalledForward"):
        old = torch_adapter.CPForward
    assert old is torch_adapter.InstalledForward
    assert old is not hp_cp_core.CPForward  # the core's: another concept, its own name
    with pytest.raises(AttributeError, match="no_such_name"):
        torch_adapter.no_such_name  # noqa: B018
