"""The model contract and its runner: what a model fills, and the machinery that runs it.

* :mod:`~hp_cp_torch.model.spec`: :class:`~hp_cp_torch.model.spec.ModelAdapter`, the hooks a
  model fills (:data:`~hp_cp_torch.model.spec.REQUIRED` says which, per layer kind), checked
  when a model class is defined, and the read-only views its hooks receive;
* :mod:`~hp_cp_torch.model.runner`: :class:`~hp_cp_torch.model.runner.LayerRunner`, which runs
  one layer's hooks through the core's stages (no model overrides it);
* :mod:`~hp_cp_torch.model.registry`: which adapter runs a module (entry-point group
  ``hp_cp.torch_models``, or :func:`~hp_cp_torch.model.registry.register_model_adapter`);
* :mod:`~hp_cp_torch.model.validation`: the tensor checks of one forward, before any collective;
* :mod:`~hp_cp_torch.model.indexer_loss`: the lightning indexer's KL loss, one code for the
  reference layer and the CP path.

May import the core, :mod:`hp_cp_torch.distributed`, :mod:`hp_cp_torch.kernels` and the
kernel dispatch :mod:`hp_cp_torch.attention`; never what installs it (:mod:`hp_cp_torch.adapter`,
the plugin) nor a model file (``tests/test_import_graph.py``).
"""
