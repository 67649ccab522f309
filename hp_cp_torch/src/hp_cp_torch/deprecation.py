"""The names 0.3.0 replaced, kept for one release: each call warns, naming its replacement.

Every deprecated name of hp_cp_torch is defined here (the integration modules re-export them
under their 0.2 names), so the message, the release that removes them and the code that goes
with them are in one place: 0.4.0 deletes this module's functions and the re-exports.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any

from hp_cp_core import HpCpError

REMOVED_IN = "0.4.0"
"""The release that removes the names deprecated in 0.3.0."""

INTEGRATIONS = "hp_cp_torch.integrations"


def warn_deprecated(old: str, replacement: str, stacklevel: int = 3) -> None:
    """A :class:`DeprecationWarning` at the caller's caller (``stacklevel``): ``old`` goes in
    0.4.0, use ``replacement``."""
    warnings.warn(
        f"{old} is deprecated since hp_cp 0.3.0 and will be removed in {REMOVED_IN}; use "
        f"{replacement} instead.",
        DeprecationWarning,
        stacklevel=stacklevel,
    )


def _integration(name: str) -> Any:
    return importlib.import_module(f"{INTEGRATIONS}.{name}")


# --------------------------------------------------------------------------- enable / disable


def _enable_cp(old: str, model: Any, mesh: Any, config: Any, refusal: str | None) -> Any:
    """The deprecated ``enable_cp`` wrappers: warn, raise ``refusal`` (what the wrapper
    refused in 0.2), else ``hp_cp_core.enable_cp``."""
    import hp_cp_core

    warn_deprecated(f"{INTEGRATIONS}.{old}", "hp_cp_core.enable_cp", stacklevel=4)
    if refusal is not None:
        raise HpCpError(refusal)
    return hp_cp_core.enable_cp(model, mesh, config, backend="torch")


def _layers(model: Any, found: Callable[[Any], Any]) -> bool:
    return any(found(mod) is not None for mod in model.modules())


def _none_found(model: Any, what: str, models: str) -> str:
    return f"found no NeMo Automodel {what} in a `{type(model).__name__}`; pass {models}."


def nemo_enable_cp(model: Any, mesh: Any, config: Any = None) -> Any:
    """Deprecated (0.3.0): ``hp_cp_core.enable_cp(model, mesh, config)`` runs NeMo's
    DeepSeek V4, V4.1 and GLM-5 (the adapters' ``prepare_model``); this one still names the
    NeMo layer it found none of."""
    nemo, v41, dsa = (
        _integration(n) for n in ("nemo_automodel", "nemo_automodel_v41", "nemo_automodel_dsa")
    )
    ok = v41.is_v41_model(model) or dsa.is_dsa_model(model) or _layers(model, nemo.nemo_adapter_for)
    refusal = (
        None
        if ok
        else _none_found(
            model,
            "DeepseekV4Attention",
            "nemo_automodel's DeepseekV4ForCausalLM, DeepseekV4Model or a DeepseekV4Attention",
        )
    )
    return _enable_cp("nemo_automodel.enable_cp", model, mesh, config, refusal)


def enable_cp_v41(model: Any, mesh: Any, config: Any = None) -> Any:
    """Deprecated (0.3.0): ``hp_cp_core.enable_cp(model, mesh, config)`` runs NeMo's
    DeepSeek V4.1 the same way (``prepare_v41_model``); this one still names the V4.1 layer
    it found none of."""
    found = _layers(model, _integration("nemo_automodel_v41").nemo_v41_adapter_for)
    refusal = (
        None
        if found
        else _none_found(
            model,
            "DeepseekV41Attention",
            "nemo_automodel's DeepseekV41ForCausalLM, DeepseekV41Model or a layer",
        )
    )
    return _enable_cp("nemo_automodel_v41.enable_cp_v41", model, mesh, config, refusal)


def enable_cp_dsa(model: Any, mesh: Any, config: Any = None) -> Any:
    """Deprecated (0.3.0): ``hp_cp_core.enable_cp(model, mesh, config)`` runs NeMo's GLM-5
    the same way (the positions pre-hook, V3.2 refused); this one still names the GLM-5
    layer it found none of."""
    found = _layers(model, _integration("nemo_automodel_dsa").nemo_dsa_adapter_for)
    refusal = (
        None
        if found
        else _none_found(
            model,
            "GlmMoeDsaMLA",
            "nemo_automodel's GlmMoeDsaForCausalLM, GlmMoeDsaModel or a GlmMoeDsaMLA",
        )
    )
    return _enable_cp("nemo_automodel_dsa.enable_cp_dsa", model, mesh, config, refusal)


def veomni_enable_cp(model: Any, mesh: Any, config: Any = None) -> Any:
    """Deprecated (0.3.0): ``hp_cp_core.enable_cp(model, mesh, config)`` runs VeOmni's
    DeepSeek V4 the same way (``prepare_veomni_model`` refuses VeOmni's own CP / Ulysses);
    this one also refuses a model built without VeOmni's modeling imported."""
    import sys

    veomni = _integration("veomni")
    problem, refusal = veomni._veomni_sp_problem(), None
    if problem is not None:
        refusal = f"enable_cp on {type(model).__name__}: {problem}"
    elif veomni.VEOMNI_MODELING not in sys.modules:
        refusal = (
            f"enable_cp: {veomni.VEOMNI_MODELING} is not imported; build the model from VeOmni "
            "(or use hp_cp_core.enable_cp for the transformers model)."
        )
    return _enable_cp("veomni.enable_cp", model, mesh, config, refusal)


def _disable_cp(old: str, handle: Any) -> None:
    import hp_cp_core

    warn_deprecated(f"{INTEGRATIONS}.{old}", "hp_cp_core.disable_cp", stacklevel=4)
    hp_cp_core.disable_cp(handle)


def nemo_disable_cp(handle: Any) -> None:
    """Deprecated (0.3.0): ``hp_cp_core.disable_cp(handle)``, which this calls."""
    _disable_cp("nemo_automodel.disable_cp", handle)


def veomni_disable_cp(handle: Any) -> None:
    """Deprecated (0.3.0): ``hp_cp_core.disable_cp(handle)``, which this calls."""
    _disable_cp("veomni.disable_cp", handle)


# --------------------------------------------------------------------------- batch builders


def _as_dict(batch: Any, **extra: Any) -> dict[str, Any]:
    """A :class:`hp_cp_core.CPBatch` as the 0.2 builders' dict."""
    out = {
        "input_ids": batch.input_ids,
        "position_ids": batch.position_ids,
        "labels": batch.labels,
        "n_tokens": batch.n_tokens,
    }
    return {**out, **extra}


def cp_causal_lm_batch(
    handle: Any, input_ids: Any, labels: Any = None, ignore_index: int = -100
) -> dict[str, Any]:
    """Deprecated (0.3.0): ``handle.batch(input_ids, labels=labels)``, the one batch path
    (:meth:`hp_cp_core.CPHandle.batch`), gives the same tensors as a
    :class:`~hp_cp_core.CPBatch`.

    Returns:
        ``input_ids``, ``position_ids``, ``labels`` (this rank's rows) and ``n_tokens``.
    """
    warn_deprecated(
        f"{INTEGRATIONS}.transformers.cp_causal_lm_batch", "handle.batch(input_ids, labels=labels)"
    )
    return _as_dict(handle.batch(input_ids, labels=labels, ignore_index=ignore_index))


def cp_dsa_batch(
    handle: Any,
    input_ids: Any,
    labels: Any = None,
    *,
    cu_seqlens: Any = None,
    ignore_index: int = -100,
) -> dict[str, Any]:
    """Deprecated (0.3.0): ``handle.batch(input_ids, labels=labels, cu_seqlens=cu_seqlens)``,
    the one batch path (:meth:`hp_cp_core.CPHandle.batch`); pass
    ``**batch.model_inputs()`` to the model.

    Returns:
        ``input_ids``, ``position_ids``, ``labels``, ``n_tokens`` and ``model_kwargs``
        (``{"hp_cp_cu_seqlens": ...}`` when packed, else empty).
    """
    from hp_cp_core.batch import CU_SEQLENS_KWARG

    warn_deprecated(
        f"{INTEGRATIONS}.transformers_dsa.cp_dsa_batch",
        "handle.batch(input_ids, labels=labels, cu_seqlens=cu_seqlens)",
    )
    batch = handle.batch(input_ids, labels=labels, cu_seqlens=cu_seqlens, ignore_index=ignore_index)
    kwargs = {} if batch.cu_seqlens is None else {CU_SEQLENS_KWARG: batch.cu_seqlens}
    return _as_dict(batch, model_kwargs=kwargs)


def nemo_cp_batch(
    handle: Any,
    input_ids: Any,
    labels: Any = None,
    *,
    seq_lens: Any = None,
    packed_seq_ids: Any = None,
    ignore_index: int = -100,
) -> dict[str, Any]:
    """Deprecated (0.3.0): ``cp_nemo_batch``, the same call under the name every stack's
    batch helper now has (``cp_<stack>_batch``)."""
    nemo = _integration("nemo_automodel")
    warn_deprecated(
        f"{INTEGRATIONS}.nemo_automodel.nemo_cp_batch", f"{nemo.__name__}.cp_nemo_batch"
    )
    return nemo.cp_nemo_batch(
        handle,
        input_ids,
        labels,
        seq_lens=seq_lens,
        packed_seq_ids=packed_seq_ids,
        ignore_index=ignore_index,
    )


def nemo_v41_cp_batch(
    handle: Any,
    input_ids: Any,
    labels: Any,
    cu: Any,
    shifted: Any,
    ignore_index: int,
) -> dict[str, Any]:
    """Deprecated (0.3.0): ``cp_nemo_batch`` lays out V4.1 batches too (``shifted`` is
    ignored: the one batch path shifts)."""
    warn_deprecated(
        f"{INTEGRATIONS}.nemo_automodel_v41.nemo_v41_cp_batch",
        f"{INTEGRATIONS}.nemo_automodel.cp_nemo_batch",
    )
    batch = handle.batch(input_ids, labels=labels, cu_seqlens=cu, ignore_index=ignore_index)
    out = _integration("nemo_automodel_v41").v41_batch_inputs(handle, batch, input_ids)
    return {**out, "labels": batch.labels, "n_tokens": batch.n_tokens}
