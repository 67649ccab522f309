"""hp_cp_jax: an example hp_cp backend for JAX, written from the public API of hp-cp-core.

Importing this package imports no framework (hp_cp discovery loads ``hp_cp_jax.plugin`` in
every process that uses hp_cp); :mod:`hp_cp_jax.layer` and :mod:`hp_cp_jax.backend` import
JAX.
"""
