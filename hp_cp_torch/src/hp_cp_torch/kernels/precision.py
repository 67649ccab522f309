"""The precision the attention computes in: each kernel's, and the model's own on request.

Note [Attention precision]
~~~~~~~~~~~~~~~~~~~~~~~~~~
Every hp_cp attention kernel (:data:`KERNEL_PRECISION`) upcasts its bf16 / fp16 inputs and
computes the logits, the softmax with the sink and the weighted sum in fp32, casting only the
output (and, in backward, the input gradients) back to the inputs' dtype. The Triton, banded
(V4, the default) and picked (DSA) kernels round the weights to the inputs' dtype for their
products with the values, as flash attention does, and accumulate those products in fp32. A
model's own eager attention in bf16 (transformers' ``eager_attention_forward``) rounds the
logits, the probabilities and the output to bf16 at each op. So in bf16 CP does not round as
one device does, and that is what sets the two apart (with ``attention_precision="model"`` a
run through the CP path lands near the model's own bf16 forward:
``tests/torch/test_precision.py``). Measured at the published widths (``python -m
hp_cp_torch.bench.precision``), CP is as close to the fp32 model as one process in bf16. Where
a run must round as the model does, ``CPConfig(attention_precision="model")`` runs the
integration's copy of the model's op sequence in the model's dtype instead of a kernel
(transformers' eager attention for DeepSeek V4, also under VeOmni's generated copy and NeMo's
V4, whose adapters reuse it; transformers' ``expand_kv`` order for V3.2 / GLM-5, NeMo's for
NeMo's GLM-5). It keeps each query's gathered columns for backward (the small-op kernel's
memory); integrations without such a path (NeMo's V4.1, the reference layer) refuse it at
``enable_cp``. The kernel ``attention_kernel="model_ops"`` (the model's own op order; before
0.3.0 ``"smallop"`` meant it on the HF integrations) runs the same path
(:func:`uses_model_precision`); where an adapter has no such path it runs the small-op kernel,
in fp32."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from hp_cp_torch.kernels.registry import SHIPPED, kernel_precision, uses_model_op_order

__all__ = ["KERNEL_PRECISION", "uses_model_precision"]

KERNEL_PRECISION: Mapping[str, str] = MappingProxyType(
    {name: kernel_precision(name) for name in SHIPPED if not uses_model_op_order(name)}
)
"""What each shipped kernel computes its logits, softmax and weighted sum in, whatever its
inputs' dtype (the Triton kernel multiplies bf16 / fp16 tiles exactly and accumulates in
fp32; fp32 inputs as IEEE fp32); the output is cast to the inputs' dtype. Each kernel states
it as its ``precision`` attribute (:func:`hp_cp_torch.kernels.registry.kernel_precision`, a
third party's kernel too); ``model_ops`` computes in the model's dtype. Note [Attention
precision]."""


def uses_model_precision(config: Any) -> bool:
    """Whether an adapter with the model's op sequence runs it rather than a kernel:
    ``attention_precision="model"``, or the ``"model_ops"`` kernel (the model's own op
    order, :func:`hp_cp_torch.kernels.registry.uses_model_op_order`)."""
    return config.attention_precision == "model" or uses_model_op_order(config.attention_kernel)
