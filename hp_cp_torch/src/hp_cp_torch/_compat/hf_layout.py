"""0.4's ``hp_cp_torch.hf_layout``, now ``hp_cp_torch.integrations.hf_layout``
(Note [Old import paths])."""

from hp_cp_torch._compat import alias

alias(__name__)
