"""The ``hp-cp`` command (:mod:`~hp_cp_torch.cli.commands`, also ``python -m hp_cp_torch.cli``),
its demo (:mod:`~hp_cp_torch.cli.demo`) and the in-process launcher of gloo ranks that the demo,
the benchmarks and the tests use (:mod:`~hp_cp_torch.cli.launch`).

May import every layer below it but not the benchmarks, which it reaches only through the
entry-point group ``hp_cp.commands`` (``tests/test_import_graph.py``).
"""
