"""Attributing parameter-free merges (concatenation, feature interaction) to their consumer.

The layering pass assigns an equation that reads no parameters to the layer of its latest
producer. For a merge of parallel branches that producer is the last branch, which would make
the last branch, rather than the head, the place where all branches meet. NNX puts no module
names on the Jaxpr name stack, but the pass honours explicit ``jax.named_scope`` names that
equal a parameter layer's path, so each model names its merge after the first layer that
consumes it (e.g. ``head/layers/0``): the merge then joins that layer and every branch keeps
a single outgoing edge, into the head.
"""

from __future__ import annotations

import contextlib

import jax


def merge_scope(consumer_layer: str) -> contextlib.AbstractContextManager:
  """A name scope that files the enclosed equations under ``consumer_layer``.

  ``consumer_layer`` is a parameter path minus its leaf name, such as ``"head/layers/0"``.
  """
  return jax.named_scope(consumer_layer)
