"""Integrations with model libraries, each loaded only when its library is installed.

One model file per library and attention family (transformers, NeMo Automodel, VeOmni,
Megatron-core): a :class:`~hp_cp_torch.model.spec.ModelAdapter` holding only its model's math,
registered under the entry-point group ``hp_cp.torch_models``; and
:mod:`~hp_cp_torch.integrations.hf_layout`, CP beside Hugging Face's own parallelism.

May import the core and everything of hp_cp_torch below it (the top-level modules,
:mod:`hp_cp_torch.model`, :mod:`hp_cp_torch.kernels`, :mod:`hp_cp_torch.distributed`); only
their entry points, the command line and the benchmarks reach them (``tests/test_import_graph.py``).
"""
