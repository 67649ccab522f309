"""The precision the attention computes in: each kernel's, and the model's own on request.

Note [Attention precision]
~~~~~~~~~~~~~~~~~~~~~~~~~~
Every hp_cp attention kernel (:data:`KERNEL_PRECISION`) upcasts its bf16 / fp16 inputs and
computes the logits, the softmax with the sink and the weighted sum in fp32, casting only the
output (and, in backward, the input gradients) back to the inputs' dtype. A model's own eager
attention in bf16 (transformers' ``eager_attention_forward``) rounds the logits, the
probabilities and the output to bf16 at each op. So in bf16 CP does not round as one device
does, and that is what sets the two apart (with ``attention_precision="model"`` a run through
the CP path lands near the model's own bf16 forward: ``tests/torch/test_precision.py``).
Measured at the published widths (``python -m hp_cp_torch.bench.precision``), CP is as close
to the fp32 model as one process in bf16. Where a run must round as the model does,
``CPConfig(attention_precision="model")`` runs the integration's copy of the
model's op sequence in the model's dtype instead of a kernel (transformers' eager attention
for DeepSeek V4, also under VeOmni's generated copy and NeMo's V4, whose adapters reuse it;
transformers' ``expand_kv`` order for V3.2 / GLM-5, NeMo's for NeMo's GLM-5). It keeps each
query's gathered columns for backward (the small-op kernel's memory); integrations without
such a path (NeMo's V4.1, the reference layer) refuse it at ``enable_cp``. The kernel
``attention_kernel="model_ops"`` (the model's own op order; before 0.3.0 ``"smallop"`` meant
it on the HF integrations) runs the same path (:func:`uses_model_precision`); where an
adapter has no such path it runs the small-op kernel, in fp32.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any

from hp_cp_core import HpCpError
from hp_cp_torch.kernels.registry import SHIPPED, kernel_precision, uses_model_op_order

__all__ = ["KERNEL_PRECISION", "check_attention_precision", "uses_model_precision"]

KERNEL_PRECISION: Mapping[str, str] = MappingProxyType(
    {name: kernel_precision(name) for name in SHIPPED if not uses_model_op_order(name)}
)
"""What each shipped kernel computes its logits, softmax and weighted sum in, whatever its
inputs' dtype (the Triton kernel multiplies bf16 / fp16 tiles exactly and accumulates in
fp32; fp32 inputs as IEEE fp32); the output is cast to the inputs' dtype. Each kernel states
it as its ``precision`` attribute (:func:`hp_cp_torch.kernels.registry.kernel_precision`, a
third party's kernel too); ``model_ops`` computes in the model's dtype. Note [Attention
precision]."""

MODEL_PATH_ATTR = "model_precision_attention"
"""An adapter class attribute: ``True`` where the adapter can run the model's own attention
op sequence in the model's dtype (``attention_precision="model"``); a
:class:`~hp_cp_torch.model_adapter.ModelAdapter` says so by overriding ``model_attention``."""


def uses_model_precision(config: Any) -> bool:
    """Whether an adapter with the model's op sequence runs it rather than a kernel:
    ``attention_precision="model"``, or the ``"model_ops"`` kernel (the model's own op
    order, :func:`hp_cp_torch.kernels.registry.uses_model_op_order`)."""
    return config.attention_precision == "model" or uses_model_op_order(config.attention_kernel)


def has_model_attention(adapter: Any) -> bool:
    """Whether ``adapter`` has a copy of the model's own attention op sequence: it says so
    (:data:`MODEL_PATH_ATTR`) or overrides ``ModelAdapter.model_attention``."""
    if getattr(adapter, MODEL_PATH_ATTR, False):
        return True
    owner = next((c for c in type(adapter).__mro__ if "model_attention" in vars(c)), None)
    return owner is not None and owner.__module__ != "hp_cp_torch.model_adapter"


def check_attention_precision(layers: Iterable[Any], adapters: Iterable[Any], config: Any) -> None:
    """Refuse ``attention_precision="model"`` (before anything is installed, the same on
    every rank) on a layer whose adapter has no copy of the model's op sequence."""
    if getattr(config, "attention_precision", "fp32") != "model":
        return
    lacking = [
        type(layer).__name__
        for layer, adapter in zip(layers, adapters)
        if adapter is not None and not has_model_attention(adapter)
    ]
    if lacking:
        names = sorted(set(lacking))
        raise HpCpError(
            f"CPConfig(attention_precision='model'): hp_cp has no copy of the "
            f"model's own attention ops for {names}; its kernels compute the attention in fp32 "
            "(hp_cp_torch.precision.KERNEL_PRECISION). Use attention_precision='fp32'."
        )
