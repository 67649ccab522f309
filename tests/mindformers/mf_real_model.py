"""The REAL mindformers 2.1.0 pynative DeepSeek V4 model (``PyNativeDeepseekV4ForCausalLM``), tiny,
on MindSpore 2.10 CPU (import ``mf_real_env`` first: stubs and CPU stand-ins). Used by the
whole-model checks (``mf_model_check.py``, one process; ``mf_model_msrun_worker.py``, msrun)
and the recipe ``examples/train_mindformers_cp.py`` has its own copy of the config (users do
not import tests).

``tiny_model(mtp=...)`` has 3 decoder layers (sliding window r = 0, CSA r = 4 with the
indexer, HCA r = 128: a sequence longer than 128 has a slot), MoE in every layer (4 routed
experts, top-2, a shared expert, expert bias), hyper-connections (4 residual streams) and
``mtp`` multi-token-prediction layers, fp32, seeded weights the same on every rank.
``loss_and_grads`` runs one training step's forward and backward with the model's own
per-token loss (``calculate_per_token_loss``: the summed loss and the token count, so CP
ranks can divide by the GLOBAL count).
"""

from __future__ import annotations

from typing import Any

import mindspore as ms
import numpy as np
from mindspore import Tensor

VOCAB = 128
WINDOW = 8
HCA_RATIO = 128


def tiny_config(mtp: int = 0, seq_length: int = 64, aux_loss: float = 0.0) -> Any:
    from mindformers.models.deepseek4.configuration_deepseek_v4 import DeepseekV4Config

    return DeepseekV4Config(
        vocab_size=VOCAB,
        hidden_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_nextn_predict_layers=mtp,
        num_attention_heads=4,
        n_shared_experts=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        head_dim=32,
        v_head_dim=32,
        q_lora_rank=48,
        qk_rope_head_dim=8,
        o_lora_rank=16,
        o_groups=2,
        index_n_heads=4,
        index_head_dim=16,
        index_topk=4,
        num_hash_layers=0,
        compress_ratios=[0, 4, HCA_RATIO] + [0] * mtp,
        sliding_window=WINDOW,
        max_position_embeddings=4096,
        seq_length=seq_length,
        compute_dtype="fp32",
        params_dtype="fp32",
        use_flash_attention=False,
        apply_dsa_kernel_fusion=False,
        moe_grouped_gemm=True,  # False: "moe_grouped_gemm = 'False' is not supported now."
        moe_permute_fusion=True,  # the unfused path needs CumsumExt inside Tensor.__getitem__
        calculate_per_token_loss=True,
        dsa_indexer_loss_coeff=0.5,
        mtp_loss_scaling_factor=0.3,
        moe_aux_loss_coeff=aux_loss,
        # the DeepSeek V2/V3 sequence-wise loss (the default, "sub_seq_aux_loss", is not in
        # the pynative router); used only when moe_aux_loss_coeff > 0
        moe_router_load_balancing_type="seq_aux_loss",
    )


def seed_weights(model: Any, seed: int = 0) -> None:
    """Seeded weights (the real init leaves ``mint.empty`` memory): norms and gains near 1,
    every other trainable weight ``N(0, 0.2^2)``; the buffers as the model's own
    ``reset_parameter`` sets them (RMS gains 1, expert bias and token counts 0)."""
    rng = np.random.default_rng(seed)
    trainable = {p.name for p in model.trainable_params()}
    for p in sorted(model.get_parameters(), key=lambda p: p.name):
        shape = tuple(p.shape)
        leaf = p.name.rsplit(".", 2)
        if p.name not in trainable:
            value = np.ones(shape) if "rms" in p.name else np.zeros(shape)
        elif "norm" in p.name or leaf[-1] in ("hc_scale",):
            value = 1.0 + 0.1 * rng.standard_normal(shape)
        else:
            value = 0.2 * rng.standard_normal(shape)
        p.set_data(Tensor(value.astype(np.float32)))


def tiny_model(mtp: int = 0, seed: int = 0, train: bool = True, aux_loss: float = 0.0) -> Any:
    from mindformers.models.deepseek4.modeling_deepseek_v4_pynative import (
        PyNativeDeepseekV4ForCausalLM,
    )

    model = PyNativeDeepseekV4ForCausalLM(tiny_config(mtp, aux_loss=aux_loss))
    seed_weights(model, seed)
    model.set_train(train)
    return model


def sample(seq: int, seed: int, batch: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Token ids ``[batch, seq]`` and their next-token labels (the last label of each row
    wraps to the first id: any fixed label works, it only has to be the same on every rank)."""
    ids = np.random.default_rng(seed).integers(1, VOCAB, (batch, seq)).astype(np.int32)
    return ids, np.roll(ids, -1, axis=1)


def _unused_mask() -> Tensor:
    """An ``attention_mask`` for the model to pass along: DeepSeek V4's hybrid attention
    ignores it, and without one the model builds a causal mask of the CONFIG's
    ``seq_length`` (which a CP rank's local rows do not match)."""
    return Tensor(np.zeros((1, 1, 1, 1), np.uint8))


def loss_and_grads(
    model: Any,
    ids: np.ndarray,
    labels: np.ndarray,
    loss_mask: np.ndarray,
    *,
    total_tokens: float,
    actual_seq_len: np.ndarray | None = None,
) -> tuple[float, dict[str, np.ndarray]]:
    """One training step's forward and backward: ``sum(token losses) / total_tokens`` (the
    model's own masked per-token loss; ``total_tokens`` the GLOBAL count of loss tokens, so the
    CP ranks' losses and parameter gradients sum to the one-device ones) and every trainable
    parameter's gradient by name."""
    params = model.trainable_params()
    asl = None if actual_seq_len is None else Tensor(np.asarray(actual_seq_len, np.int32))

    def step(i, lab, mask):
        numerator, _ = model(
            input_ids=i,
            labels=lab,
            loss_mask=mask,
            attention_mask=_unused_mask(),
            actual_seq_len=asl,
        )
        return numerator / total_tokens

    loss, grads = ms.value_and_grad(step, None, params)(
        Tensor(ids), Tensor(labels), Tensor(loss_mask.astype(np.float32))
    )
    model.reset_model_temporary_tensors()
    return float(loss.asnumpy()), {p.name: g.asnumpy() for p, g in zip(params, grads)}


def logits(
    model: Any, ids: np.ndarray, labels: np.ndarray, actual_seq_len: np.ndarray | None = None
) -> np.ndarray:
    """The model's logits ``[batch * seq, vocab]`` (evaluation mode: the model returns them;
    ``labels``: its MTP layers want them even then)."""
    asl = None if actual_seq_len is None else Tensor(np.asarray(actual_seq_len, np.int32))
    was = model.training
    model.set_train(False)
    try:
        out = model(
            input_ids=Tensor(ids),
            labels=Tensor(labels),
            attention_mask=_unused_mask(),
            actual_seq_len=asl,
        )
    finally:
        model.set_train(was)
    return out.asnumpy()
