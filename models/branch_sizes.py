"""Per-branch sizes in configs: one int for every branch, or a tuple with one entry each."""

from __future__ import annotations


def per_branch(name: str, value: int | tuple[int, ...], num_branches: int) -> tuple[int, ...]:
  """Expands ``value`` to one size per branch; raises if a tuple has the wrong length."""
  if isinstance(value, int):
    return (value,) * num_branches
  if len(value) != num_branches:
    raise ValueError(
      f"{name} has {len(value)} entries for {num_branches} branches; give one "
      "per branch or a single int for all"
    )
  return tuple(int(v) for v in value)
