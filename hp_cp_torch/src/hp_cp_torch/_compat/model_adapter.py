"""0.4's ``hp_cp_torch.model_adapter``, now ``hp_cp_torch.model.spec``
(Note [Old import paths])."""

from hp_cp_torch._compat import alias

alias(__name__)
