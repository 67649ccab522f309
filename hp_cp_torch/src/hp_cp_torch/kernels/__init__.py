"""The sparse-attention kernels: the same attention with an optional sink, computed five ways.

* :mod:`~hp_cp_torch.kernels.smallop`: gathers the selected rows (the exact reference);
* :mod:`~hp_cp_torch.kernels.efficient`: chunked, recomputes in backward (memory flat in K);
* :mod:`~hp_cp_torch.kernels.banded`: the window (and HCA's slots) as dense bands, the top-k
  gathered (the default);
* :mod:`~hp_cp_torch.kernels.triton_attention`: fused Triton kernels, whose programs are
  :mod:`~hp_cp_torch.kernels.triton_kernels` (imports ``triton``).

They share the softmax of :mod:`~hp_cp_torch.kernels.softmax` (no sink, and rows that see
nothing). Each is registered by name in :mod:`~hp_cp_torch.kernels.registry` (one calling
convention, :mod:`~hp_cp_torch.kernels.shipped`); :func:`hp_cp_torch.attention.run_sparse_attention`
runs the one ``CPConfig.attention_kernel`` names, a third party's too.
:mod:`~hp_cp_torch.kernels.picked` serves grouped and latent heads, and
:mod:`~hp_cp_torch.kernels.latent_attention` runs MLA on the latents (``kv_b_proj`` folded in)
through it; :mod:`~hp_cp_torch.kernels.megatron` wraps Megatron-core's own kernel;
:mod:`~hp_cp_torch.kernels.precision` says what precision each kernel computes in.

May import the core and other kernels only: a kernel executes a plan and knows no model,
runner or backend (``tests/test_import_graph.py``).
"""
