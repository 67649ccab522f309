"""A Llama-style decoder converted to DeepSeek Sparse Attention, and its hp_cp adapter."""
