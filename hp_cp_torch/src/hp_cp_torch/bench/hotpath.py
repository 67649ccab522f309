"""What the steady-state hot path asks of the host and of the store: counted, not timed.

A 4-layer Hugging Face ``DeepseekV4ForCausalLM`` (the demo's tiny config, layers sliding,
CSA, HCA, CSA) trains at cp = 2 on gloo, ``enable_cp`` with the defaults. After
:data:`WARMUP` steps (plans built, agreements recorded) the bench counts over
:data:`STEPS` steps, per rank, with instrumentation it installs itself:

* ``host_syncs_per_step``: device-to-host reads inside the CP code: calls of
  ``Tensor.cpu / item / tolist / numpy``, ``bool / int / float / index`` of a tensor,
  ``equal / allclose``, ops whose output shape depends on the values (``nonzero``,
  ``unique``, ``masked_select``, ...), and boolean-mask indexing (:func:`is_host_read`), made
  with a frame of ``hp_cp_core`` / ``hp_cp_torch`` on the stack between the read and the
  bench's step (CP layer forwards, their input checks and agreement, the CP autograd
  functions' backward). A ``TorchFunctionMode`` (:func:`HostReads`) sees every such call; on
  this CPU they cost nothing, on a GPU each one drains the launch queue. ``.to("cpu")`` is
  not counted (on this CPU it cannot be told from a move to the group's device). The
  model's own reads (HF's packed-sequence check of ``position_ids``: one per forward) are
  left out; the model-wide count is ``host_syncs_per_step_model``.
* ``store_ops_per_step``: operations on the desync report's store (a counting wrapper
  around it, :class:`CountingStore`).
* ``cp_collectives_per_step`` and ``agreements_per_step`` (``all_gather_meta`` calls; the
  target is <= 1 per model forward), from the group's counters and the handle's
  :class:`~hp_cp_core.validation.AgreementMemo`.
* ``store_ops_per_step_1024_ranks_61_layers``: the per-rank count divided by the model's 4
  CP layers, times 61 layers and 1,024 ranks: the operations the store's one host serves per
  step. ``..._old`` is the same figure for the code before the flight recorder, which wrote
  the store once per collective entered (one ``set`` per collective, Note [Desync report]
  before issue 22), and ran one agreement per layer: its per-rank count is the collectives
  entered per step plus the agreements now reused.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

__all__ = ["CountingStore", "HostReads", "hotpath_measures", "is_host_read"]

WARMUP = 2
STEPS = 3
N_LAYERS = 4
SEQ = 128
READS = frozenset(
    {"cpu", "item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__"}
    | {"is_nonzero", "equal", "allclose"}
)
"""The ``Tensor`` methods and functions that read a tensor's values on the host."""

SHAPED_BY_DATA = frozenset(
    {"nonzero", "argwhere", "unique", "unique_consecutive", "masked_select", "bincount"}
)
"""Ops whose output shape depends on the values: on a GPU the host waits for them."""


def is_host_read(name: str, args: tuple, kwargs: dict) -> bool:
    """Whether a call seen by the bench's ``TorchFunctionMode`` reads device values on the
    host: :data:`READS`, :data:`SHAPED_BY_DATA`, ``repeat_interleave`` by a tensor of repeats
    without ``output_size``, and indexing (get or set) with a boolean mask."""
    import torch

    if name in READS or name in SHAPED_BY_DATA:
        return True
    if name == "repeat_interleave":
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        return isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None
    if name in ("__getitem__", "__setitem__") and len(args) > 1:
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index)
    return False


class CountingStore:
    """A store wrapper that counts every operation on it."""

    def __init__(self, store: Any) -> None:
        self.store, self.ops = store, 0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.store, name)
        if not callable(attr):
            return attr

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.ops += 1
            return attr(*args, **kwargs)

        return counted


def _from_cp_code(frame: FrameType | None) -> bool:
    """Whether a frame of ``hp_cp_core`` or ``hp_cp_torch`` is on the stack between the read
    and this bench's training step (the launcher's frames above the step do not count)."""
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name == __name__:
            return False
        if name.startswith(("hp_cp_core", "hp_cp_torch")):
            return True
        frame = frame.f_back
    return False


def HostReads() -> Any:  # noqa: N802 - a class made on first use (torch imported lazily)
    """A ``TorchFunctionMode`` counting host reads (:func:`is_host_read`) into its
    ``counts``: ``model`` (all), ``cp`` (made from hp_cp code, :func:`_from_cp_code`) and
    ``agreement`` (the ``cpu`` calls among those). Reading the last ``.cpu()`` result again
    is not a second read."""
    from torch.overrides import TorchFunctionMode

    class _HostReads(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.counts = {"cp": 0, "model": 0, "agreement": 0}
            self.copied: Any = None

        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
            name = getattr(func, "__name__", "")
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            if is_host_read(name, args, kwargs) and not (args and args[0] is self.copied):
                self.counts["model"] += 1
                if _from_cp_code(sys._getframe(1)):
                    self.counts["cp"] += 1
                    self.counts["agreement"] += int(name == "cpu")  # agreement / input check
            if name == "cpu":
                self.copied = out
            return out

    return _HostReads()


def _worker(rank: int, world: int, warmup: int, steps: int, seq: int) -> dict[str, float]:
    import torch

    from hp_cp_core import CPConfig, disable_cp, enable_cp
    from hp_cp_torch.cli.parity import (
        CSA,
        HCA,
        SLIDING,
        build_tiny_model,
        make_inputs,
    )
    from hp_cp_torch.integrations.transformers import cp_causal_lm_loss, cp_shift_labels

    torch.set_num_threads(1)
    layers = [SLIDING, CSA, HCA, CSA]
    model = build_tiny_model(
        0,
        num_hidden_layers=N_LAYERS,
        layer_types=layers,
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
    ).train()
    ids = make_inputs(128, 1, seq)
    pos = torch.arange(seq)[None]
    handle = enable_cp(model, None, CPConfig(layout="load_balanced"))
    group, memo = handle.group, handle.agreements
    labels = cp_shift_labels(ids)
    n_tok = (labels != -100).sum()
    ids, pos, labels = (handle.shard(t, 1) for t in (ids, pos, labels))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        out = model(input_ids=ids, position_ids=pos, use_cache=False)
        cp_causal_lm_loss(out.logits, labels, n_tok).backward()
        opt.step()
        opt.zero_grad()

    reads = HostReads()
    for _ in range(warmup):
        step()
    store = group.log.store = CountingStore(group.log.store)
    calls_before = sum(group.calls.values())
    seq0, agreed0, reused0 = group.log.seq, memo.collectives, memo.reused
    with reads:
        for _ in range(steps):
            step()
    counts = reads.counts
    res = {
        "host_syncs": counts["cp"] / steps,
        "host_syncs_model": counts["model"] / steps,
        "host_syncs_agreement": counts["agreement"] / steps,
        "store_ops": store.ops / steps,
        "collectives": (group.log.seq - seq0) / steps,
        "agreements": (memo.collectives - agreed0) / steps,
        "reused": (memo.reused - reused0) / steps,
        "calls": (sum(group.calls.values()) - calls_before) / steps,
    }
    group.log.store = store.store
    disable_cp(handle)
    return res


def hotpath_measures(
    warmup: int = WARMUP, steps: int = STEPS, seq: int = SEQ, world: int = 2
) -> dict[str, float]:
    """The ``host_syncs_per_step``, ``store_ops_per_step`` ... keys (module docstring); the
    worst rank's figure."""
    from hp_cp_torch.cli.launch import run_ranks

    ranks = run_ranks(world, _worker, warmup, steps, seq)
    worst = {k: max(r[k] for r in ranks) for k in ranks[0]}
    scale = 61 / N_LAYERS * 1024
    old_per_rank = worst["collectives"] + worst["reused"]
    return {
        "host_syncs_per_step": worst["host_syncs"],
        "host_syncs_per_step_model": worst["host_syncs_model"],
        "host_syncs_per_step_agreement": worst["host_syncs_agreement"],
        "store_ops_per_step": worst["store_ops"],
        "cp_collectives_per_step": worst["collectives"],
        "agreements_per_step": worst["agreements"],
        "agreements_reused_per_step": worst["reused"],
        "model_forwards_per_step": 1.0,
        "store_ops_per_step_1024_ranks_61_layers": worst["store_ops"] * scale,
        "store_ops_per_step_1024_ranks_61_layers_old": old_per_rank * scale,
        "hotpath_layers": float(N_LAYERS),
        "hotpath_cp": float(world),
    }


if __name__ == "__main__":
    import json

    print(json.dumps(hotpath_measures(), indent=1))
