"""Flax NNX models used in examples, tests and benchmarks."""
