"""0.4's ``hp_cp_torch.indexer_loss``, now ``hp_cp_torch.model.indexer_loss``
(Note [Old import paths])."""

from hp_cp_torch._compat import alias

alias(__name__)
