"""gpp-jax: graph pipeline parallelism for JAX."""
