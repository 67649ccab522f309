"""0.4's ``hp_cp_torch.runner``, now ``hp_cp_torch.model.runner``
(Note [Old import paths])."""

from hp_cp_torch._compat import alias

alias(__name__)
