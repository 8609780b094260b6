"""Checkpoints of training state that do not depend on the plan: ``save``, ``restore``.

A checkpoint holds the state as the user holds it: one logical pytree of whole arrays (a Linen
``TrainState``, NNX modules and ``nnx.Optimizer`` objects, plain pytrees of arrays, or a dict or
tuple of those), written with orbax. Where a pipelined step left each leaf (on the devices of
the stage that owns it) is not part of the checkpoint: ``restore`` puts every leaf where the
state passed in holds it, and the next pipelined step moves it to its stage. So a run saved
under one plan resumes under another plan, on another device count, or without a pipeline, and
the values are bit-identical to the ones saved.

Usage::

  gpp_jax.checkpoint.save("ckpt", state, step=100)          # Linen TrainState, any pytree
  state = gpp_jax.checkpoint.restore("ckpt", state)         # the latest step

  gpp_jax.checkpoint.save("ckpt", {"model": model, "optimizer": optimizer}, step=100)
  gpp_jax.checkpoint.restore("ckpt", {"model": model, "optimizer": optimizer})  # NNX: in place

Each step is a folder ``<directory>/<step>``; orbax writes it under a temporary name and renames
it when complete, so a save that fails (or a process killed mid-save) leaves the earlier
checkpoints as they were, and ``latest_step`` never returns a partial one.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import SingleDeviceSharding

from gpp_jax.errors import CheckpointError

FORMAT = 1
_STATE, _META = "state", "meta"
_SHOWN = 8  # mismatching leaves named per kind of mismatch


def _is_graph_object(x) -> bool:
  """NNX modules and optimizers: saved as their ``nnx.state``, restored in place."""
  return isinstance(x, nnx.Pytree)


def _key_name(k) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(k, attr):
      return str(getattr(k, attr))
  return str(k)


def _names(path) -> tuple[str, ...]:
  return tuple(_key_name(k) for k in path)


def _is_key(x) -> bool:
  dtype = getattr(x, "dtype", None)
  return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _describe(x) -> tuple[tuple[int, ...], str]:
  """(shape, dtype name) of a leaf; PRNG keys by their key dtype (``key<fry>``)."""
  if isinstance(x, jax.Array | jax.ShapeDtypeStruct | np.ndarray | np.generic):
    return tuple(x.shape), str(x.dtype)
  if isinstance(x, bool | int | float | complex):
    return (), str(_scalar_dtype(x))
  raise TypeError(type(x).__name__)


def _scalar_dtype(x) -> np.dtype:
  """The dtype JAX gives a Python number (int32 and float32 unless 64-bit JAX is on)."""
  return np.dtype(jax.dtypes.canonicalize_dtype(np.asarray(x).dtype))


class _Flat:
  """A state flattened to named leaves: the top-level pytree with NNX objects as leaves, and for
  each of its leaves either the array or the NNX object's pure state dict."""

  def __init__(self, state: Any):
    top, self.treedef = jax.tree_util.tree_flatten_with_path(state, is_leaf=_is_graph_object)
    self.top = [x for _, x in top]
    self.leaves: list[tuple[str, Any]] = []  # ("a/b/c", leaf) in order
    self.pure: dict[int, Any] = {}  # top index -> the NNX object's pure dict
    for i, (path, x) in enumerate(top):
      names = _names(path)
      if _is_graph_object(x):
        pure = nnx.to_pure_dict(nnx.state(x))
        self.pure[i] = pure
        for sub, v in jax.tree_util.tree_flatten_with_path(pure)[0]:
          self.leaves.append((_join(names + _names(sub)), v))
      else:
        self.leaves.append((_join(names), x))
    taken = {name for name, _ in self.leaves}
    clash = len(taken) < len(self.leaves) or any(
      "/".join(name.split("/")[:k]) in taken
      for name in taken
      for k in range(1, name.count("/") + 1)
    )
    if clash:
      raise CheckpointError(
        "the state's leaf names clash (a dict key holds '/', so two paths read alike); use "
        "dict keys without '/'"
      )

  def describe(self) -> dict[str, tuple[tuple[int, ...], str]]:
    out = {}
    for name, x in self.leaves:
      try:
        out[name] = _describe(x)
      except TypeError:
        raise CheckpointError(
          f"leaf {name!r} of the state is a {type(x).__name__}, not an array; a checkpoint "
          "holds arrays and numbers only (keep other values out of the state, or mark them "
          "static in the pytree)"
        ) from None
    return out

  def rebuild(self, values: Sequence[Any]) -> tuple[Any, list[tuple[Any, Any]]]:
    """The state with ``values`` (in leaf order) put in; NNX objects are returned with the
    updates to apply to them (``nnx.update`` is left to the caller, after every read)."""
    it = iter(values)
    top, updates = [], []
    for i, x in enumerate(self.top):
      if i in self.pure:
        pure = self.pure[i]
        n = len(jax.tree.leaves(pure))
        new = jax.tree.unflatten(jax.tree.structure(pure), [next(it) for _ in range(n)])
        updates.append((x, new))
        top.append(x)
      else:
        top.append(next(it))
    return jax.tree.unflatten(self.treedef, top), updates


def _join(names: tuple[str, ...]) -> str:
  return "/".join(names) if names else "value"


def _nest(flat: dict[str, Any]) -> dict:
  out: dict = {}
  for name, v in flat.items():
    *parents, last = name.split("/")
    d = out
    for p in parents:
      d = d.setdefault(p, {})
    d[last] = v
  return out


def _manager(directory: str, *, keep: int | None = None, create: bool = True):
  if jax.process_count() > 1:
    # Orbax writes global arrays only (it refuses an array that one process holds whole), and a
    # pipelined state's leaves each live on one process's devices.
    raise CheckpointError(
      "gpp_jax.checkpoint runs in a single process; in a multi-process run it is not "
      "supported yet (each leaf of a pipelined state lives on one process's devices, which "
      "orbax does not save)"
    )
  options = ocp.CheckpointManagerOptions(
    max_to_keep=keep,
    enable_async_checkpointing=False,
    create=create,
  )
  return ocp.CheckpointManager(os.path.abspath(directory), options=options)


def latest_step(directory: str) -> int | None:
  """The newest complete checkpoint's step in ``directory``, or None when it has none."""
  if not os.path.isdir(directory):
    return None
  with _manager(directory, create=False) as m:
    return m.latest_step()


def all_steps(directory: str) -> list[int]:
  """The steps of the complete checkpoints in ``directory``, oldest first."""
  if not os.path.isdir(directory):
    return []
  with _manager(directory, create=False) as m:
    return sorted(m.all_steps())


def save(
  directory: str,
  state: Any,
  *,
  step: int,
  extra: dict | None = None,
  keep: int | None = None,
) -> str:
  """Writes ``state`` as checkpoint ``step`` in ``directory`` and returns its folder.

  Args:
    directory: the checkpoint folder (created if missing); each step is a subfolder.
    state: the training state as you hold it: a Linen ``TrainState``, NNX modules and
      optimizers, pytrees of arrays, or a dict/tuple of those. Arrays may live on any devices
      (a pipelined step leaves each on its stage's); the checkpoint holds whole arrays.
    step: the step number (an integer >= 0) that names the checkpoint.
    extra: JSON values stored beside the state (data position, seeds, ...); see ``extra``.
    keep: keep only the newest ``keep`` checkpoints (default: all).

  Nothing is donated or changed: ``state`` stays usable. The folder appears only when complete.
  In a multi-process run every process calls ``save`` with the same arguments.
  """
  if not isinstance(step, int | np.integer) or isinstance(step, bool) or step < 0:
    raise CheckpointError(f"step must be an integer >= 0, got {step!r}")
  step = int(step)
  try:
    extra_json = json.loads(json.dumps(extra or {}))
  except (TypeError, ValueError) as e:
    raise CheckpointError(
      f"extra must hold JSON values (numbers, strings, lists, dicts): {e}"
    ) from None
  flat = _Flat(state)
  desc = flat.describe()
  arrays: dict[str, Any] = {}
  for name, x in flat.leaves:
    if _is_key(x):
      x = jax.random.key_data(x)
    elif isinstance(x, bool | int | float | complex):
      x = np.asarray(x, _scalar_dtype(x))
    elif not isinstance(x, jax.Array):
      x = np.asarray(x)
    arrays[name] = x
  meta = {
    "format": FORMAT,
    "step": step,
    "leaves": {name: [list(shape), dtype] for name, (shape, dtype) in desc.items()},
    "key_impls": {name: str(jax.random.key_impl(x)) for name, x in flat.leaves if _is_key(x)},
    "extra": extra_json,
  }
  with _manager(directory, keep=keep) as m:
    if step in m.all_steps():
      raise CheckpointError(
        f"{directory} already holds a checkpoint of step {step}; save under a new step, or "
        "delete that step's folder first"
      )
    m.save(
      step,
      args=ocp.args.Composite(
        **{_STATE: ocp.args.StandardSave(_nest(arrays)), _META: ocp.args.JsonSave(meta)}
      ),
      force=True,
    )
    m.wait_until_finished()
  return os.path.join(os.path.abspath(directory), str(step))


def _read_meta(m, directory: str, step: int | None) -> tuple[int, dict]:
  steps = m.all_steps()
  if step is None:
    if not steps:
      raise CheckpointError(f"{directory} holds no checkpoint; save one first")
    step = max(steps)
  elif step not in steps:
    raise CheckpointError(
      f"{directory} has no checkpoint of step {step}; it has steps {sorted(steps)}"
    )
  try:
    meta = m.restore(step, args=ocp.args.Composite(**{_META: ocp.args.JsonRestore()}))[_META]
  except (KeyError, FileNotFoundError, ValueError):
    meta = None  # another program's orbax checkpoint: it has no such item
  if not isinstance(meta, dict) or meta.get("format") != FORMAT:
    raise CheckpointError(
      f"{directory}/{step} is not a gpp_jax checkpoint (format {FORMAT}); write it with "
      "gpp_jax.checkpoint.save"
    )
  return step, meta


def extra(directory: str, step: int | None = None) -> dict:
  """The ``extra`` values saved with checkpoint ``step`` (default: the latest)."""
  if not os.path.isdir(directory):
    raise CheckpointError(f"no checkpoint folder {directory}")
  with _manager(directory, create=False) as m:
    return _read_meta(m, directory, step)[1]["extra"]


def _mismatch_message(directory, step, saved: dict, want: dict) -> str | None:
  missing = [n for n in want if n not in saved]
  unexpected = [n for n in saved if n not in want]
  differ = [
    f"{n}: checkpoint {_fmt(saved[n])}, state {_fmt(want[n])}"
    for n in want
    if n in saved and saved[n] != want[n]
  ]
  if not (missing or unexpected or differ):
    return None
  parts = [
    f"the checkpoint {directory}/{step} does not match the state passed to restore "
    "(another model, size, dtype or optimizer?):"
  ]
  for title, items in (
    ("not in the checkpoint", missing),
    ("in the checkpoint but not in the state", unexpected),
    ("different shape or dtype", differ),
  ):
    if items:
      shown = ", ".join(items[:_SHOWN]) + (
        f" (and {len(items) - _SHOWN} more)" if len(items) > _SHOWN else ""
      )
      parts.append(f"  {len(items)} {title}: {shown}")
  parts.append(
    "Restore into a state built like the saved one (same model, configuration, dtype and "
    "optimizer); the state passed in is unchanged."
  )
  return "\n".join(parts)


def _fmt(d: tuple[tuple[int, ...], str]) -> str:
  shape, dtype = d
  return f"{dtype}[{','.join(map(str, shape))}]"


def _target_sharding(x):
  if isinstance(x, jax.Array):
    return x.sharding
  if isinstance(x, jax.ShapeDtypeStruct) and x.sharding is not None:
    return x.sharding
  return SingleDeviceSharding(jax.devices()[0])


def restore(directory: str, target: Any, *, step: int | None = None) -> Any:
  """Reads checkpoint ``step`` (default: the latest) of ``directory`` into the form of ``target``.

  ``target`` is the state as you hold it (the same kinds ``save`` takes), built like the saved
  one, e.g. freshly initialised; ``jax.ShapeDtypeStruct`` leaves (``jax.eval_shape``) also
  work. Returns the restored state. NNX modules and optimizers in ``target`` are updated in
  place (and returned); other leaves are new arrays placed where ``target``'s leaves are (its
  shardings; NumPy leaves stay NumPy, abstract leaves without a sharding go to the first
  device). A pipelined step then moves each to its stage, whatever plan saved them.

  A checkpoint of another model (leaves missing, extra, or of another shape or dtype) raises
  ``CheckpointError`` naming those leaves, before anything is read or changed.
  """
  if not os.path.isdir(directory):
    raise CheckpointError(f"no checkpoint folder {directory}")
  flat = _Flat(target)
  want = flat.describe()
  with _manager(directory, create=False) as m:
    step, meta = _read_meta(m, directory, step)
    saved = {n: (tuple(shape), dtype) for n, (shape, dtype) in meta["leaves"].items()}
    msg = _mismatch_message(directory, step, saved, want)
    if msg:
      raise CheckpointError(msg)
    abstract: dict[str, Any] = {}
    for name, x in flat.leaves:
      if isinstance(x, np.ndarray | np.generic):
        abstract[name] = np.zeros(x.shape, x.dtype)
        continue
      if isinstance(x, bool | int | float | complex):  # a step counter, say: as the step returns it
        shape, dtype = (), _scalar_dtype(x)
      else:
        shape, dtype = tuple(x.shape), x.dtype
      if _is_key(x):
        data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(shape, dtype))
        shape, dtype = data.shape, data.dtype
      abstract[name] = jax.ShapeDtypeStruct(shape, dtype, sharding=_target_sharding(x))
    read = m.restore(
      step, args=ocp.args.Composite(**{_STATE: ocp.args.StandardRestore(_nest(abstract))})
    )[_STATE]
  values = []
  for name, x in flat.leaves:
    v = read
    for p in name.split("/"):
      v = v[p]
    if _is_key(x):
      v = jax.random.wrap_key_data(v, impl=meta["key_impls"][name])
    values.append(v)
  state, updates = flat.rebuild(values)
  for obj, pure in updates:  # every read succeeded: now change the objects passed in
    st = nnx.state(obj)
    nnx.replace_by_pure_dict(st, pure)
    nnx.update(obj, st)
  return state
