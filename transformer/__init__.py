"""The Transformer of "Attention Is All You Need" for machine translation, in JAX/Flax."""
