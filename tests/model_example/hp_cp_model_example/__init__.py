"""A small sparse-attention model and its hp_cp model adapter (docs/writing-a-model-adapter.md)."""
