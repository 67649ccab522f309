"""``attention_kernel="megatron"``: megatron-core's own DSA sparse attention on hp_cp's
exchange, run by the Megatron adapter (:mod:`hp_cp_torch.integrations.megatron_kernel`).

The kernel object only asks for the adapter's own attention (``model_op_order``); it imports
nothing of Megatron's, so the registry can name it below the integrations.
"""

from __future__ import annotations

import torch

from hp_cp_core import HpCpError
from hp_cp_torch.kernels.request import AttentionRequest

__all__ = ["MEGATRON", "MegatronKernel"]


class MegatronKernel:
    """``attention_kernel="megatron"``: Megatron's own sparse attention on hp_cp's gathered
    prefix. It asks for the adapter's own
    attention (``model_op_order``), which :class:`~hp_cp_torch.integrations.megatron.
    MegatronDSAAttentionAdapter` answers with Megatron's sparse attention (Note [Megatron's
    kernel on hp_cp's prefix] in :mod:`hp_cp_torch.integrations.megatron_kernel`); a layer
    whose adapter has no attention of its own reaches :meth:`__call__`, which refuses."""

    model_op_order = True
    precision = "model"
    """Megatron's: the scores and softmax in fp32, the weighted sum in the latents' dtype
    (its fused backends: theirs)."""

    def __call__(self, request: AttentionRequest) -> torch.Tensor:
        raise HpCpError(
            "attention_kernel='megatron' runs megatron-core's own DSA sparse attention and "
            "only on the layers of hp_cp_torch.integrations.megatron (Megatron's "
            "AbsorbedMLASelfAttention); this layer has no Megatron attention. Pick one of "
            "hp_cp's kernels (the default 'banded')."
        )


MEGATRON = MegatronKernel()
