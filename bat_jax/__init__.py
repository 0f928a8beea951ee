"""bat-jax: Benchmark-as-Teacher (BaT) in JAX."""

__version__ = "0.1.0"
