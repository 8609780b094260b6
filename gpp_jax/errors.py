"""Exception types. Every error names what is wrong and how to fix it."""


def counted(n: int, noun: str, plural: str | None = None) -> str:
  """``n`` and ``noun``, in the plural unless n is 1 ("1 stage", "3 stages"), for messages."""
  return f"{n} {noun if n == 1 else plural or noun + 's'}"


class GppError(Exception):
  """Base class of gpp-jax errors."""


class PlanError(GppError, ValueError):
  """A plan that is invalid for the model or the devices."""


class ScheduleError(GppError, ValueError):
  """A schedule that violates a dependency, is incomplete, or deadlocks."""


class CaptureError(GppError, ValueError):
  """A train step or loss function that cannot be captured or staged."""


class BatchError(GppError, ValueError):
  """A batch that does not split into micro-batches."""


class CheckpointError(GppError, ValueError):
  """A checkpoint that is missing or does not match the state it is restored into."""
