"""0.4's ``hp_cp_torch.exit``, now ``hp_cp_torch.distributed.exit``
(Note [Old import paths])."""

from hp_cp_torch._compat import alias

alias(__name__)
