"""0.4's ``hp_cp_torch.desync``, now ``hp_cp_torch.distributed.desync``
(Note [Old import paths])."""

from hp_cp_torch._compat import alias

alias(__name__)
