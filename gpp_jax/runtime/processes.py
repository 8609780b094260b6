"""Multi-process set-up on top of stock ``jax.distributed``.

Every process runs the same training script. ``initialize`` starts JAX's distributed runtime
and enables JAX's cross-host ``device_put`` (which needs a socket address per process); the
pipeline driver then moves activations and cotangents between processes with ordinary
``jax.device_put`` calls issued in the same order on every process.

Locally, ``python -m gpp_jax.launch`` starts the processes and passes their coordinates in the
``GPP_*`` environment variables read by ``initialize_from_env``.
"""

from __future__ import annotations

import itertools
import os
import time
from typing import Any

import jax
from absl import logging

from gpp_jax.errors import GppError, PlanError
from gpp_jax.ir.plan import Plan
from gpp_jax.runtime import liveness

ENV_COORDINATOR = "GPP_COORDINATOR"
ENV_NUM_PROCESSES = "GPP_NUM_PROCESSES"
ENV_PROCESS_ID = "GPP_PROCESS_ID"
ENV_LOCAL_DEVICES = "GPP_LOCAL_DEVICES"
ENV_TRANSFER_ADDRESS = "GPP_TRANSFER_ADDRESS"
ENV_HEARTBEAT_TIMEOUT = "GPP_HEARTBEAT_TIMEOUT_S"


def initialize(
  coordinator_address: str | None = None,
  num_processes: int | None = None,
  process_id: int | None = None,
  *,
  transfer_address: str | None = None,
  cpu_devices: int | None = None,
  initialization_timeout: int = 120,
  heartbeat_timeout_s: float = 20.0,
) -> None:
  """Starts ``jax.distributed`` for a pipelined run.

  Args:
    coordinator_address: ``host:port`` of process 0 (None: the cluster's environment, as
      ``jax.distributed.initialize()`` detects it, e.g. SLURM).
    num_processes, process_id: as for ``jax.distributed.initialize``.
    transfer_address: ``host:port`` this process listens on for cross-process transfers
      (JAX's ``jax_cross_host_transfer_socket_address``); required when stages of one pipeline
      live on different processes.
    cpu_devices: force this many CPU devices in this process (local development and tests).
    heartbeat_timeout_s: a peer process silent this long is lost: waits of the pipeline raise
      ``PeerLost`` naming it (see ``gpp_jax.runtime.liveness``). JAX's own coordination service
      is given twice this (plus 5 s) before it aborts the processes that remain, so a process
      that died anywhere ends the others within about that time.
  """
  if cpu_devices is not None:
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", int(cpu_devices))
  if transfer_address:
    jax.config.update("jax_cross_host_transfer_socket_address", transfer_address)
  kwargs: dict[str, Any] = {}
  if coordinator_address is not None:
    kwargs = dict(
      coordinator_address=coordinator_address, num_processes=num_processes, process_id=process_id
    )
  jax.distributed.initialize(
    initialization_timeout=initialization_timeout,
    heartbeat_timeout_seconds=int(2 * heartbeat_timeout_s + 5),
    **kwargs,
  )
  from jax._src import distributed as jax_distributed  # the coordination service client

  liveness.start(
    jax_distributed.global_state.client,
    jax.process_index(),
    jax.process_count(),
    heartbeat_timeout_s,
  )
  logging.info(
    "process %d of %d: %d local devices, %d global",
    jax.process_index(),
    jax.process_count(),
    jax.local_device_count(),
    jax.device_count(),
  )


def initialize_from_env() -> bool:
  """Initialises from the ``GPP_*`` variables set by ``gpp_jax.launch``; False if absent.

  ``GPP_HEARTBEAT_TIMEOUT_S``, when set (by the user: the launcher passes its environment
  on), is ``initialize``'s ``heartbeat_timeout_s``: the seconds of silence after which a peer
  process counts as lost (default 20; lower notices a dead peer sooner, higher tolerates
  longer pauses of a live one).
  """
  if ENV_COORDINATOR not in os.environ:
    return False
  heartbeat: dict[str, Any] = {}
  if os.environ.get(ENV_HEARTBEAT_TIMEOUT):
    heartbeat["heartbeat_timeout_s"] = float(os.environ[ENV_HEARTBEAT_TIMEOUT])
  initialize(
    os.environ[ENV_COORDINATOR],
    int(os.environ[ENV_NUM_PROCESSES]),
    int(os.environ[ENV_PROCESS_ID]),
    transfer_address=os.environ.get(ENV_TRANSFER_ADDRESS),
    cpu_devices=int(os.environ[ENV_LOCAL_DEVICES]) if ENV_LOCAL_DEVICES in os.environ else None,
    **heartbeat,
  )
  return True


_EXCHANGES: dict[str, itertools.count] = {}


def exchange(topic: str, value: str, timeout_s: float) -> list[str]:
  """Every process's ``value`` for the next exchange on ``topic``, in process order.

  Goes through the key-value store of JAX's coordination service (the ``jax.distributed``
  client), not through device collectives: nothing is compiled, and a process that never
  arrives (it failed or stalls before this point) makes the others raise ``GppError`` after
  ``timeout_s`` instead of waiting forever. Every process must make the same exchanges on a
  topic in the same order.
  """
  from jax._src import distributed as jax_distributed  # the coordination service client

  client = jax_distributed.global_state.client
  if client is None:
    raise GppError("several processes but no jax.distributed client: call initialize() first")
  n = next(_EXCHANGES.setdefault(topic, itertools.count()))
  me = jax.process_index()
  client.key_value_set(f"gpp_jax/{topic}/{n}/{me}", value)
  with liveness.waiting(f"every process's {topic}") as wait:

    def failed(what: str, e: Exception) -> GppError:
      reason = str(e).split("\n")[0][:200]
      return GppError(
        f"{what} after waiting {time.monotonic() - wait.since:.1f} s (timeout {timeout_s:g} "
        f"s; this is process {me}): a process failed or stalls before the pipeline's first "
        f"step, or the coordination service on process 0 has gone; see the other processes' "
        f"logs ({type(e).__name__}: {reason})"
      )

    def get(p: int) -> str:
      """Process ``p``'s value, polled in slices of at most a second so that a lost peer
      noticed by ``liveness`` ends the wait; ``failed`` after ``timeout_s``."""
      while True:
        left = timeout_s - (time.monotonic() - wait.since)
        try:
          key = f"gpp_jax/{topic}/{n}/{p}"
          return client.blocking_key_value_get(key, max(1, int(min(left, 1.0) * 1e3)))
        except Exception as e:  # the client raises its runtime's error type
          liveness.check(wait)
          if left <= 1.0 or "DEADLINE_EXCEEDED" not in str(e):
            raise failed(f"process {p} did not report its {topic}", e) from e

    out = [value if p == me else get(p) for p in range(jax.process_count())]
    # Everyone has read everything before anyone acts on it (a process that raises and exits
    # takes the coordination service with it when it is process 0).
    try:
      left = timeout_s - (time.monotonic() - wait.since)
      client.wait_at_barrier(f"gpp_jax/{topic}/{n}", max(1, int(left * 1e3)))
    except Exception as e:
      liveness.check(wait)
      raise failed(f"the processes did not all read the {topic}", e) from e
  return out


def check_same_plan(plan: Plan, timeout_s: float = 300.0) -> None:
  """Raises ``PlanError`` unless every process has the same plan (by ``Plan.fingerprint``).

  Processes that plan separately from different numbers (their own layer timings, another
  planner option) would run different schedules and deadlock on each other's transfers;
  this check runs before the first step instead.
  """
  mine = plan.fingerprint()
  every = exchange("plan", mine, timeout_s)
  differ = [p for p, f in enumerate(every) if f != every[0]]
  if differ:
    raise PlanError(
      f"processes {differ} planned differently from process 0 (this is process "
      f"{jax.process_index()}, plan {mine[:12]}: {plan.num_stages} stages, "
      f"{plan.num_microbatches} micro-batches, schedule {plan.schedule}). Every process must "
      "run the same plan: give them the same planner, options and layer times (calibration "
      "takes process 0's), or pass one saved plan, planner=gpp_jax.Plan.load(path)."
    )
