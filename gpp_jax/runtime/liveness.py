"""Which peer processes are alive: a heartbeat through JAX's coordination service.

JAX's coordination service notices a process that stopped sending heartbeats after
``heartbeat_timeout_seconds`` and then aborts every other process (SIGABRT) without saying what
it was waiting for. ``Liveness`` notices first: each process writes a counter to the service's
key-value store every ``period_s`` and reads the others'; a peer whose counter has not moved
for ``timeout_s`` (or, for process 0, whose store can no longer be reached: it runs the
service) is lost. Waits of the pipeline (``exchange``, ``wait_for``) run under ``waiting``,
poll ``check`` and raise ``PeerLost``, naming the lost process and the seconds they actually
waited; a loss while no such wait runs is logged at once (JAX's own abort follows).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import threading
import time
from collections.abc import Iterator
from typing import Any

from absl import logging

from gpp_jax.errors import GppError

DONE = "done"


class PeerLost(GppError):
  """A peer process died or stopped answering; the run cannot go on."""


@dataclasses.dataclass(frozen=True)
class Loss:
  """A lost peer: ``process``, seconds it had been silent when noticed, and how it showed."""

  process: int
  silent_s: float
  noticed_at: float  # time.monotonic()
  how: str


@dataclasses.dataclass
class _Wait:
  what: str
  since: float


class Liveness:
  """Heartbeats of this process and a watch on the others' (see the module docstring)."""

  def __init__(self, client: Any, me: int, num_processes: int, timeout_s: float, period_s: float):
    self.client, self.me, self.n = client, me, num_processes
    self.timeout_s, self.period_s = float(timeout_s), float(period_s)
    self.lost: Loss | None = None
    self.changed = threading.Event()  # set when a loss is noticed
    self._stop = threading.Event()
    self._waits: list[_Wait] = []
    self._lock = threading.Lock()
    self._heard: dict[int, float] = {}  # peer -> when its counter last moved (monotonic)

  def start(self) -> None:
    threading.Thread(target=self._beat, daemon=True, name="gpp-heartbeat").start()
    threading.Thread(target=self._watch, daemon=True, name="gpp-watch").start()
    atexit.register(self.stop)  # runs before JAX's shutdown (registered earlier)

  def stop(self) -> None:
    """Stops watching; tells the others this process ended on purpose."""
    if self._stop.is_set():
      return
    self._stop.set()
    with contextlib.suppress(Exception):
      self.client.key_value_set(self._key(self.me), DONE, allow_overwrite=True)

  def _key(self, p: int) -> str:
    return f"gpp_jax/alive/{p}"

  def _beat(self) -> None:
    count = 0
    while not self._stop.wait(self.period_s if count else 0.0):
      count += 1
      try:
        self.client.key_value_set(self._key(self.me), str(count), allow_overwrite=True)
      except Exception:  # the service is gone; the watch reports it
        return

  def _watch(self) -> None:
    start = time.monotonic()
    seen: dict[int, tuple[str | None, float]] = dict.fromkeys(range(self.n), (None, start))
    done: set[int] = set()  # ended on purpose
    while not self._stop.wait(self.period_s):
      now = time.monotonic()
      for p in range(self.n):
        if p == self.me:
          continue
        try:
          value: str | None = self.client.key_value_try_get(self._key(p))
        except Exception as e:
          if "NOT_FOUND" not in str(e):  # the store itself is unreachable: process 0 is gone
            if not self._stop.is_set() and 0 not in done:
              self._lose(Loss(0, now - seen[0][1], now, "its coordination service went away"))
            return
          value = None
        if value == DONE:
          done.add(p)
          continue
        if value != seen[p][0]:
          seen[p] = (value, now)
          self._heard[p] = now
        elif now - seen[p][1] > self.timeout_s:
          how = "it sent no heartbeat" if value is not None else "it never sent a heartbeat"
          self._lose(Loss(p, now - seen[p][1], now, how))
          return

  def _lose(self, loss: Loss) -> None:
    self.lost = loss
    self.changed.set()
    with self._lock:
      waits = list(self._waits)
    if not waits:
      logging.error("%s", self.message(loss, None))

  def message(self, loss: Loss, wait: _Wait | None) -> str:
    waited = ""
    if wait is not None:
      waited = f" after waiting {time.monotonic() - wait.since:.1f} s for {wait.what}"
    return (
      f"process {loss.process} of {self.n} was lost ({loss.how} for {loss.silent_s:.1f} s): "
      f"this is process {self.me}, stopping{waited}. The process has died or stalls; see its "
      "log."
    )

  def name_the_lost(self, how: str, silent_s: float = 3.0, within_s: float = 6.0) -> None:
    """After a sign that some peer is gone (a broken transfer, ``how``): waits up to
    ``within_s`` for a peer silent ``silent_s`` (far less than ``timeout_s``: the sign is
    strong) and records it as lost; nothing if every peer keeps beating."""
    end = time.monotonic() + within_s
    while self.lost is None and time.monotonic() < end:
      now = time.monotonic()
      quiet = [p for p, t in sorted(self._heard.items()) if now - t >= silent_s]
      if quiet:
        self._lose(Loss(quiet[0], now - self._heard[quiet[0]], now, how + "; it sent no heartbeat"))
        return
      self.changed.wait(0.2)

  @contextlib.contextmanager
  def waiting(self, what: str) -> Iterator[_Wait]:
    w = _Wait(what, time.monotonic())
    with self._lock:
      self._waits.append(w)
    try:
      yield w
    finally:
      with self._lock:
        self._waits.remove(w)

  def check(self, wait: _Wait) -> None:
    """Raises ``PeerLost`` if a peer has been lost."""
    if self.lost is not None:
      raise PeerLost(self.message(self.lost, wait))


_CURRENT: Liveness | None = None


def start(client: Any, me: int, num_processes: int, timeout_s: float, period_s: float = 1.0):
  """Starts watching the peers of this process (once per process)."""
  global _CURRENT
  if _CURRENT is None and num_processes > 1:
    _CURRENT = Liveness(client, me, num_processes, timeout_s, period_s)
    _CURRENT.start()
  return _CURRENT


def current() -> Liveness | None:
  """The watch started by ``start``, or None (one process, or not set up by gpp_jax)."""
  return _CURRENT


@contextlib.contextmanager
def waiting(what: str) -> Iterator[_Wait]:
  """A wait for ``what`` that ``check`` can name; works without a watch too."""
  live = _CURRENT
  if live is None:
    yield _Wait(what, time.monotonic())
    return
  with live.waiting(what) as w:
    yield w


def check(wait: _Wait) -> None:
  """Raises ``PeerLost`` if the watch has noticed a lost peer."""
  if _CURRENT is not None:
    _CURRENT.check(wait)
