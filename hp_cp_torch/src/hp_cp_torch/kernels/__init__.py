"""The sparse-attention kernels: the same attention with a sink, computed five ways.

* :mod:`~hp_cp_torch.kernels.smallop`: gathers the selected rows (the exact reference);
* :mod:`~hp_cp_torch.kernels.efficient`: chunked, recomputes in backward (memory flat in K);
* :mod:`~hp_cp_torch.kernels.banded`: the window (and HCA's slots) as dense bands, the top-k
  gathered (the default);
* :mod:`~hp_cp_torch.kernels.triton_attention`: fused Triton kernels, whose programs are
  :mod:`~hp_cp_torch.kernels.triton_kernels` (imports ``triton``).

:func:`hp_cp_torch.attention.run_sparse_attention` picks one by name
(``DeepSeekV4CPConfig.attention_kernel``).
"""
