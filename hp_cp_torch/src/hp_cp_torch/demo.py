"""Moved to :mod:`hp_cp_torch.cli.demo` (0.2): warns, removed in 0.3."""

from hp_cp_torch._moved import alias_module

alias_module(__name__, "hp_cp_torch.cli.demo")
