"""A small megatron-core 0.19.2 ``GPTModel`` whose layers are MLA + DSA, built on CPU (gloo) from
Megatron's own spec, for the megatron tests.

The layers come from the official
``megatron.core.models.gpt.experimental_attention_variant_module_specs.
get_transformer_layer_with_experimental_attention_variant_spec`` with ``transformer_impl="local"``
and ``dsa_kernel_backend="none"``: ``TransformerLayer`` -> ``AbsorbedMLASelfAttention``
(``transformer/experimental_attention_variant/absorbed_mla.py``) -> ``DSAttention`` ->
``DSAIndexer`` (``transformer/experimental_attention_variant/dsa.py``). Two things the local
backend lacks are supplied here, without touching megatron:

- ``LocalSpecProvider`` (``models/backends.py:99``) has no ``linear()``, which
  ``get_dsa_module_spec_for_backend`` calls (``experimental_attention_variant_module_specs.py:96-
  120``: the indexer's ``linear_wq_b``/``linear_wk``/``linear_weights_proj`` and MLA's
  ``linear_q_down_proj``/``linear_kv_down_proj``; ``AttributeError`` without it).
  ``LocalDSASpecProvider.linear()`` returns ``DuplicatedLinear``, a ``ColumnParallelLinear`` that
  accepts the indexer's ``parallel_mode="duplicated"`` (``dsa.py:1168``, ``:1180``, ``:1203``;
  TE's ``TELinear`` takes it, a plain ``ColumnParallelLinear`` raises ``TypeError: ... unexpected
  keyword argument 'parallel_mode'``). Tensor parallel size 1 only.
- ``AbsorbedMLASelfAttention.__init__`` accepts only ``TELinear`` / ``Linear`` /
  ``TEColumnParallelLinear`` / ``ColumnParallelLinear`` (by identity) for its two down
  projections (``absorbed_mla.py:281-291``, ``:328-338``; ``ValueError: Unsupported
  linear_q_down_proj``), so ``build_layer_specs`` sets those two to ``ColumnParallelLinear`` in
  the built spec (what the local GPT spec uses for MLA).

Weights are set from ``seed`` by parameter name (``init_weights``), so a one-process model and a
cp model built in different process-group layouts hold identical weights.

Run ``python tests/megatron/megatron_model.py`` for a one-process smoke forward + backward,
``--show-errors`` to see what each CPU shim prevents.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import zlib

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from megatron_shims import SHIMS, megatron_cpu_shims  # noqa: E402

SMALL = dict(
    num_layers=2,
    hidden_size=64,
    ffn_hidden_size=128,
    num_attention_heads=4,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_head_dim=16,
    qk_pos_emb_head_dim=16,
    v_head_dim=16,
    dsa_indexer_n_heads=4,
    dsa_indexer_head_dim=32,
    dsa_indexer_topk=16,
)
"""The default widths: hidden 64, 4 heads, kv_lora_rank 32, rope dim 16, indexer 4 x 32,
top-k 16 (selects at S >= 32)."""

VOCAB = 128


def make_config(
    *,
    context_parallel_size: int = 1,
    indexer_loss_coeff: float = 0.1,
    sparse_loss: bool = False,
    topk_freq: int = 1,
    rope_type: str = "rope",
    calculate_per_token_loss: bool = False,
    **overrides,
):
    """An fp32 ``MLATransformerConfig`` for DSA on the local backend."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    kwargs = dict(SMALL)
    kwargs.update(
        normalization="RMSNorm",
        qk_layernorm=True,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        rope_type=rope_type,
        rotary_base=10000,
        rotary_scaling_factor=1.0,
        apply_rope_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        bf16=False,
        fp16=False,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        sequence_parallel=False,
        context_parallel_size=context_parallel_size,
        cp_comm_type="allgather",
        transformer_impl="local",
        experimental_attention_variant="dsa",
        dsa_kernel_backend="none",
        dsa_indexer_loss_coeff=indexer_loss_coeff,
        dsa_indexer_use_sparse_loss=sparse_loss,
        dsa_indexer_topk_freq=topk_freq,
        calculate_per_token_loss=calculate_per_token_loss,
    )
    kwargs.update(overrides)
    return MLATransformerConfig(**kwargs)


def _duplicated_linear_cls():
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    class DuplicatedLinear(ColumnParallelLinear):
        """``ColumnParallelLinear`` accepting TE's ``parallel_mode`` keyword (the DSA indexer
        passes ``parallel_mode="duplicated"``); at tensor-parallel size 1 it is a plain linear."""

        def __init__(self, *args, parallel_mode=None, **kwargs):
            if parallel_mode not in (None, "duplicated"):
                raise ValueError(f"DuplicatedLinear: parallel_mode={parallel_mode!r}")
            config = kwargs["config"]
            if config.tensor_model_parallel_size != 1:
                raise NotImplementedError("DuplicatedLinear: tensor parallel size 1 only")
            super().__init__(*args, **kwargs)

    return DuplicatedLinear


def local_dsa_spec_provider():
    """``LocalSpecProvider`` plus the ``linear()`` the DSA spec needs."""
    from megatron.core.models.backends import LocalSpecProvider

    duplicated = _duplicated_linear_cls()

    class LocalDSASpecProvider(LocalSpecProvider):
        def linear(self) -> type:
            return duplicated

    return LocalDSASpecProvider()


def build_layer_specs(config):
    """Megatron's DSA layer specs for the local backend (see the module docstring)."""
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_transformer_layer_with_experimental_attention_variant_spec,
    )
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    backend = local_dsa_spec_provider()
    layer_specs = get_transformer_layer_with_experimental_attention_variant_spec(
        config=config, backend=backend
    )
    for spec in layer_specs:
        attn = spec.submodules.self_attention.submodules
        attn.linear_q_down_proj = ColumnParallelLinear
        attn.linear_kv_down_proj = ColumnParallelLinear
    return layer_specs, backend


def init_weights(model: torch.nn.Module, seed: int, std: float = 0.08) -> None:
    """Set every parameter from ``seed`` and its name: matrices N(0, std), vectors (norm
    weights) 1 + N(0, 0.1). Independent of build order and process-group layout."""
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            noise = torch.randn(p.shape, generator=g, dtype=torch.float64)
            if p.ndim >= 2:
                p.copy_(noise * std)
            else:
                p.copy_(1.0 + 0.1 * noise)


def build_gpt_model(config, *, seed: int = 1234, vocab_size: int = VOCAB, max_seq: int = 4096):
    """A ``GPTModel`` of MLA + DSA layers (``parallel_state`` must be initialised)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    layer_specs, backend = build_layer_specs(config)
    block = TransformerBlockSubmodules(
        layer_specs=layer_specs,
        layer_norm=backend.layer_norm(rms_norm=config.normalization == "RMSNorm"),
    )
    torch.manual_seed(seed)
    model = GPTModel(
        config=config,
        transformer_layer_spec=block,
        vocab_size=vocab_size,
        max_sequence_length=max_seq,
        pre_process=True,
        post_process=True,
        parallel_output=True,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
    )
    init_weights(model, seed)
    return model


def init_parallel(context_parallel_size: int = 1) -> None:
    """``torch.distributed`` (gloo, from the torchrun environment, else a one-rank world) and
    ``parallel_state.initialize_model_parallel(context_parallel_size=...)``."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        dist.init_process_group("gloo")
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        context_parallel_size=context_parallel_size,
        create_gloo_process_groups=False,
    )


def make_batch(batch: int = 2, seq: int = 64, *, seed: int = 7, vocab_size: int = VOCAB):
    """Token ids, labels (ids shifted by one), position ids and an all-ones loss mask, [B, S]."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (batch, seq + 1), generator=g)
    return {
        "tokens": ids[:, :-1].contiguous(),
        "labels": ids[:, 1:].contiguous(),
        "position_ids": torch.arange(seq).expand(batch, seq).contiguous(),
        "loss_mask": torch.ones(batch, seq),
        "attention_mask": None,
    }


def indexer_selects(config, seq: int) -> bool:
    """Whether top-k really selects at this length (some row has more causal keys than k)."""
    return seq > config.dsa_indexer_topk


def _smoke(show_errors: bool) -> None:
    torch.set_num_threads(1)
    init_parallel(1)
    config = make_config()
    if show_errors:
        from megatron.core.transformer.experimental_attention_variant.dsa import (
            DSAIndexerLossLoggingHelper,
        )

        for name in SHIMS:
            DSAIndexerLossLoggingHelper.tracker.clear()
            try:
                with megatron_cpu_shims(skip=(name,)):
                    _run_once(dataclasses.replace(config))
                print(f"without {name}: ran")
            except Exception as exc:  # noqa: BLE001
                print(f"without {name}: {type(exc).__name__}: {str(exc)[:200]}")
        return
    with megatron_cpu_shims():
        loss = _run_once(config)
    print(f"one-process forward+backward: loss {loss:.6f}")


def _run_once(config) -> float:
    model = build_gpt_model(config)
    b = make_batch()
    per_token = model(
        b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"]
    )  # [B, S]
    loss = (per_token * b["loss_mask"]).sum() / b["loss_mask"].sum()
    loss.backward()
    return float(loss)


if __name__ == "__main__":
    _smoke("--show-errors" in sys.argv)
