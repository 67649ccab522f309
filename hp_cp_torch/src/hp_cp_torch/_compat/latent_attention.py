"""0.4's ``hp_cp_torch.latent_attention``, now ``hp_cp_torch.kernels.latent_attention``
(Note [Old import paths])."""

from hp_cp_torch._compat import alias

alias(__name__)
