"""CP next to Hugging Face's own parallelism (``from_pretrained(..., distributed_config=)``).

:func:`cp_layout_from_hf_model` takes the CP ranks from one of HF's data-parallel mesh axes
and gives the loss the scale HF's FSDP2 expects (:class:`HFCPLayout`);
:func:`freeze_csa_indexer` keeps HF's gradient-less indexer out of the optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hp_cp_core import CPConfig, CPHandle, HpCpError, enable_cp
from hp_cp_torch.training import cp_causal_lm_loss

__all__ = ["HFCPLayout", "cp_layout_from_hf_model", "freeze_csa_indexer"]


def freeze_csa_indexer(model: nn.Module) -> int:
    """Freeze every CSA indexer parameter (``*.compressor.indexer.*``); returns how many.

    HF's indexer only feeds integer top-k ids, so it never gets a gradient (under CP or not).
    Frozen, it stays out of the optimizer, and the optimizer state (so a checkpoint) has the
    same keys on every run, resumed or not, on any layout.
    """
    params = [p for name, p in model.named_parameters() if ".compressor.indexer." in name]
    for p in params:
        p.requires_grad_(False)
    return len(params)


# HF's data-parallel axes: each rank of one holds a different batch (FSDP2 shards over both).
HF_DP_AXES = ("dp_replicate", "fsdp")
_WHY_NOT = {
    "tp": "the tensor-parallel ranks of a group compute on the same batch (they split the "
    "experts' weights, not the tokens)",
    "ep": "the expert-parallel ranks route tokens between experts of the same batches; its "
    "groups do not match HF's data-parallel groups",
    "efsdp": "it is the FSDP axis of the experts only; its groups differ from the dense "
    "model's data-parallel groups",
    "pp": "pipeline stages hold different layers, not different tokens",
}


@dataclass(frozen=True)
class HFCPLayout:
    """CP on one data-parallel axis of a model HF loaded with a ``DistributedConfig``.

    Attributes:
        axis: HF's mesh axis the CP ranks span (``"fsdp"`` or ``"dp_replicate"``).
        cp_mesh: the 1-D CP mesh (this rank's group along ``axis``), what ``enable_cp`` takes.
        dp_mesh: the 1-D mesh of the real data-parallel ranks (HF's other data-parallel axis):
            ranks holding different batches, over which the target count is summed.
        grad_divide_factor: what HF's FSDP2 divides every gradient by, ``dp_replicate_size *
            fsdp_size``: it counts the CP ranks, which hold shares of the same sequences.
    """

    axis: str
    cp_mesh: Any
    dp_mesh: Any
    grad_divide_factor: int

    @property
    def cp_size(self) -> int:
        return int(self.cp_mesh.size())

    @property
    def dp_size(self) -> int:
        """Number of different batches (data-parallel replicas, each split over CP ranks)."""
        return int(self.dp_mesh.size())

    def enable_cp(self, model: nn.Module, config: CPConfig | None = None) -> CPHandle:
        """``enable_cp(model, self.cp_mesh, config)`` and :func:`freeze_csa_indexer`."""
        handle = enable_cp(model, self.cp_mesh, config)
        freeze_csa_indexer(model)
        return handle

    def global_tokens(self, n_tokens: torch.Tensor) -> torch.Tensor:
        """Sum of the replicas' target counts (``handle.batch(...).n_tokens``) over
        the data-parallel ranks only (a CP group counts its sequences once); a collective."""
        import torch.distributed as dist

        total = torch.as_tensor(n_tokens).clone()
        dist.all_reduce(total, group=self.dp_mesh.get_group())
        return total

    def causal_lm_loss(
        self,
        logits_local: torch.Tensor,
        labels_shifted_local: torch.Tensor,
        n_tokens: torch.Tensor,
        ignore_index: int = -100,
    ) -> torch.Tensor:
        """This rank's loss to call ``backward()`` on (a collective: every rank calls it).

        :func:`cp_causal_lm_loss` over the targets of the global batch (``n_tokens``: this
        replica's count, summed by :meth:`global_tokens`) times :attr:`grad_divide_factor`:
        HF's FSDP2 averages the gradients over that many ranks, so the averaged gradient is
        the gradient of the global mean loss. The mean of these losses over the
        data-parallel x CP ranks is the global mean loss (:meth:`global_loss`).
        """
        n_global = self.global_tokens(n_tokens)
        share = cp_causal_lm_loss(logits_local, labels_shifted_local, n_global, ignore_index)
        return share * self.grad_divide_factor

    def global_loss(self, loss: torch.Tensor) -> float:
        """The global mean loss from every rank's :meth:`causal_lm_loss` (a collective)."""
        import torch.distributed as dist

        total = loss.detach().clone()
        dist.all_reduce(total, group=self.cp_mesh.get_group())
        dist.all_reduce(total, group=self.dp_mesh.get_group())
        return float(total) / self.grad_divide_factor


def _hf_mesh_manager(model: nn.Module) -> tuple[Any, Any]:
    """HF's mesh manager and ``DistributedConfig`` of a model loaded with one (clear errors)."""
    import transformers

    version = getattr(transformers, "__version__", "?")
    config = getattr(getattr(model, "config", None), "distributed_config", None)
    manager = getattr(model, "_mesh_manager", None)
    if config is None and manager is None:
        raise HpCpError(
            f"{type(model).__name__} was not loaded with a DistributedConfig (its "
            "config.distributed_config is None). Load it with "
            "from_pretrained(path, distributed_config=DistributedConfig(fsdp_size=...)), or, "
            "without HF's parallelism, call enable_cp(model, mesh) on your own mesh."
        )
    sizes = ("pp_size", "dp_replicate_size", "fsdp_size", "tp_size", "ep_size")
    if manager is None or not callable(getattr(manager, "get_mesh", None)):
        raise HpCpError(
            f"{type(model).__name__} has a DistributedConfig but no mesh manager "
            f"(model._mesh_manager.get_mesh) that hp_cp reads in transformers {version}; this "
            "transformers release lays its meshes out differently. Install transformers 5.23 "
            "(pip install 'hp-cp-torch[transformers]'), or build the CP mesh yourself and "
            "call enable_cp(model, mesh)."
        )
    if any(not isinstance(getattr(config, s, None), int) for s in sizes):
        raise HpCpError(
            f"the DistributedConfig of {type(model).__name__} lacks one of {sizes} in "
            f"transformers {version}; hp_cp supports transformers 5.23's DistributedConfig."
        )
    return manager, config


def _check_attention_replicated(model: nn.Module) -> None:
    """CP runs the attention on whole heads: refuse a ``tp_plan`` that shards it (no collective)."""
    from torch.distributed.tensor import DTensor

    for name, p in getattr(model, "named_parameters", lambda: ())():
        if ".self_attn." not in name or not isinstance(p, DTensor):
            continue
        if "tp" in (p.device_mesh.mesh_dim_names or ()):
            raise HpCpError(
                f"cp_layout_from_hf_model: the attention parameter {name} is sharded over HF's "
                "'tp' axis (a tp_plan rule names it); CP needs the attention replicated on the "
                "tensor-parallel ranks. Drop the attention rules from DistributedConfig(tp_plan="
                "...) (the default DeepSeek V4 plan shards only the experts)."
            )


def cp_layout_from_hf_model(model: nn.Module, axis: str = "fsdp") -> HFCPLayout:
    """The CP mesh, data-parallel mesh and loss scale for a model HF parallelised itself.

    For a model loaded with ``from_pretrained(path, distributed_config=DistributedConfig(...))``
    (TP / EP on the experts, FSDP2 by HF, attention replicated), CP splits each sequence
    over the ranks of one of HF's data-parallel axes: ``"fsdp"`` or ``"dp_replicate"``
    (HSDP); the other one keeps different batches. The tensor-parallel ranks of a CP rank
    share its rows, as they share its batch without CP. Every rank then::

        layout = cp_layout_from_hf_model(model, axis="fsdp")
        handle = layout.enable_cp(model)  # enable_cp(model, layout.cp_mesh), indexer frozen
        batch = handle.batch(input_ids)  # this replica's sequences
        out = model(**batch.model_inputs(), use_cache=False)
        loss = layout.causal_lm_loss(out.logits, batch.labels, batch.n_tokens)
        loss.backward()

    The batches differ across :attr:`HFCPLayout.dp_mesh` and are the same on the ranks of a
    CP group (and of a TP group). The checks need no collective, so a bad ``axis`` raises
    the same :class:`~hp_cp_core.HpCpError` on every rank.

    Raises:
        HpCpError: the model was not loaded with a ``DistributedConfig``, ``axis`` is not one
            of HF's data-parallel axes (``"tp"``, ``"ep"``, ``"efsdp"``, ``"pp"``, unknown),
            a ``tp_plan`` shards the attention, ``pp_size > 1``, or this transformers
            release lays out its meshes differently.
    """
    manager, config = _hf_mesh_manager(model)
    if axis not in HF_DP_AXES:
        why = _WHY_NOT.get(axis, "it is not an axis of HF's device mesh")
        raise HpCpError(
            f"cp_layout_from_hf_model(axis={axis!r}): CP cannot run on {axis!r}: {why}. One "
            "sequence's shards must sit on ranks that hold the same batch and differ only in "
            f"their rows: pass axis='fsdp' or axis='dp_replicate' (HF's data-parallel axes; "
            f"this model has fsdp_size={config.fsdp_size}, "
            f"dp_replicate_size={config.dp_replicate_size})."
        )
    if config.pp_size != 1:
        raise HpCpError(
            f"cp_layout_from_hf_model: DistributedConfig(pp_size={config.pp_size}) is not "
            "supported with CP; use pp_size=1."
        )
    _check_attention_replicated(model)
    other = HF_DP_AXES[1 - HF_DP_AXES.index(axis)]
    try:
        cp_mesh, dp_mesh = manager.get_mesh(axis), manager.get_mesh(other)
    except (KeyError, ValueError, RuntimeError) as exc:
        raise HpCpError(
            f"cp_layout_from_hf_model: transformers' mesh manager has no {axis!r} / {other!r} "
            f"axes ({type(exc).__name__}: {exc}); hp_cp supports transformers 5.23's layout."
        ) from exc
    return HFCPLayout(
        axis=axis,
        cp_mesh=cp_mesh,
        dp_mesh=dp_mesh,
        grad_divide_factor=int(config.dp_replicate_size * config.fsdp_size),
    )
