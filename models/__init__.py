"""Flax NNX models used in examples, tests and benchmarks.

``registry.MODELS`` lists them by name ("mmt", "dlrm", "candle_uno", "gpt"), each with its
frozen config class (``tiny()`` and ``paper()`` presets), constructor, pure loss and
synthetic batch generator. Each model's module tree mirrors its computation graph: parallel
branches are separate submodules that meet only at an explicit merge.
"""
