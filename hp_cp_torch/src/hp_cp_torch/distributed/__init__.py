"""What surrounds the collectives of :mod:`hp_cp_torch.backend`: per-forward records, the
desync report, and process groups let go at exit.

* :mod:`~hp_cp_torch.distributed.forward_scope`: which forward a layer call belongs to, so a
  recomputed forward finds the record (plan, agreement, model values) its first run filed;
* :mod:`~hp_cp_torch.distributed.desync`: where every CP rank last entered a collective, for
  the error a failed or timed-out collective raises;
* :mod:`~hp_cp_torch.distributed.exit`: process groups released before the interpreter stops.

May import the core and torch only: nothing of hp_cp_torch (``tests/test_import_graph.py``).
"""
