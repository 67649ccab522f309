"""0.4's ``hp_cp_torch.forward_scope``, now ``hp_cp_torch.distributed.forward_scope``
(Note [Old import paths])."""

from hp_cp_torch._compat import alias

alias(__name__)
