"""0.4's ``hp_cp_torch.validation``, now ``hp_cp_torch.model.validation``
(Note [Old import paths])."""

from hp_cp_torch._compat import alias

alias(__name__)
