"""``hp-cp bench`` (``python -m hp_cp_torch.bench``): the measures, one module each.

* :mod:`~hp_cp_torch.bench.suite`: the command (every measure in one run, JSON, PNG, table);
* :mod:`~hp_cp_torch.bench.traffic`: bytes each rank receives against lower bounds and peers;
* :mod:`~hp_cp_torch.bench.scaling`: step time through the CP path, cp = 2 over cp = 1;
* :mod:`~hp_cp_torch.bench.kernel`: the attention kernel's FLOP/s over ``torch.matmul``'s;
* :mod:`~hp_cp_torch.bench.memory`: a Hugging Face model's training-step memory;
* :mod:`~hp_cp_torch.bench.hotpath`: host work and collectives of a training step.

The top layer: may import anything; nothing of hp_cp_torch imports it
(``tests/test_import_graph.py``).
"""
