"""Integrations with the frameworks users train and test with.

Each module imports its framework only when it is used, so importing this
package costs nothing and needs none of them:

- :mod:`detctx.integrations.lightning`: ``DeterministicCallback`` for a
  Lightning ``Trainer`` (``pip install 'detctx[lightning]'``).
- :mod:`detctx.integrations.transformers`: ``DeterministicCallback`` for a
  Hugging Face ``Trainer`` (``pip install 'detctx[transformers]'``).
- :mod:`detctx.integrations.hypothesis`: ``register()``, so that hypothesis
  reseeds torch per example (``pip install 'detctx[hypothesis]'``).
- :mod:`detctx.integrations.megatron`: ``register_tracker()``, so that every
  block seeds, saves, restores and checkpoints Megatron's tensor-parallel RNG
  tracker (``pip install 'detctx[megatron]'``).
"""
