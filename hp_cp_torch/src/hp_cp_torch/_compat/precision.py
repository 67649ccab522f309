"""0.4's ``hp_cp_torch.precision``, now ``hp_cp_torch.kernels.precision``
(Note [Old import paths])."""

from hp_cp_torch._compat import alias

alias(__name__)
