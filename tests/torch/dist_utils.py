"""Spawned gloo ranks for the tests (the implementation lives in hp_cp_torch.cli.launch)."""

from hp_cp_torch.cli.launch import run_ranks

__all__ = ["run_ranks"]
