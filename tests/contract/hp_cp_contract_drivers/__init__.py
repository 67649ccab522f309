"""Contract-suite drivers of the torch and MindFormers backends (entry points
``hp_cp.contract``), the same mechanism a third-party backend uses; the suite itself is
``pytest -p hp_cp_core.testing.contract``. Installed editable (``pip install -e
tests/contract``): the drivers reuse ``tests/torch`` and ``tests/mindformers`` helpers."""
