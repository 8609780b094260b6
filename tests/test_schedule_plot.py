"""The schedule visualiser writes one PNG per schedule and degrades without matplotlib."""

import pytest

from gpp_jax.experiments import schedule_plot
from gpp_jax.passes.schedules import make_schedule
from gpp_jax.passes.simulation import StageTimes, simulate_times

PNG = b"\x89PNG\r\n\x1a\n"


def test_draw_schedule_writes_a_png(tmp_path):
  pytest.importorskip("matplotlib")
  sched = make_schedule("zero-bubble", 3, [(0, 1), (0, 2), (1, 2)], 4)
  res = simulate_times(
    sched, StageTimes([1e-3] * 3, [1e-3] * 3, weight=[1e-3] * 3, update=[5e-4] * 3)
  )
  name = schedule_plot.draw_schedule(res, str(tmp_path / "zb.png"), "zero-bubble")
  assert name == "zb.png"
  assert (tmp_path / "zb.png").read_bytes()[:8] == PNG
  spans = schedule_plot._spans(res)
  assert {k for k, *_ in spans} == {"F", "B", "W", "UPDATE"} and len(spans) == 3 * (3 * 4 + 1)


def test_without_matplotlib_nothing_is_drawn(tmp_path, monkeypatch, capsys):
  monkeypatch.setattr(schedule_plot, "pyplot", lambda: None)
  sched = make_schedule("1f1b", 2, [(0, 1)], 2)
  res = simulate_times(sched, StageTimes([1.0, 1.0], [2.0, 2.0]))
  assert schedule_plot.draw_schedule(res, str(tmp_path / "x.png")) is None
  assert not (tmp_path / "x.png").exists()
