"""Microbatch numbers in the timeline picture stay readable on hatched bars: there they
are dark on a light patch, so the hatch lines do not run through white digits."""

from __future__ import annotations

import matplotlib.axes

from pipeflow.sim import Event, Timeline, draw_timeline


def test_numbers_on_hatched_bars_are_dark_on_a_light_patch(tmp_path, monkeypatch):
    drawn = {}
    text = matplotlib.axes.Axes.text

    def record(self, x, y, s, *args, **kwargs):
        drawn[s] = kwargs
        return text(self, x, y, s, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "text", record)
    # one wide bar of each kind, microbatch numbers telling them apart
    kinds = {"F": 1, "B": 2, "I": 3, "W": 4}
    events = [Event(0, f"0{k}{mb}", k, 0, mb, 0, 0, float(i), i + 1.0) for i, (k, mb) in enumerate(kinds.items())]
    path = draw_timeline(Timeline(events, 1), tmp_path / "t.png", title="")
    assert path.endswith("t.png")
    for kind, mb in kinds.items():
        label = drawn[str(mb)]
        if kind == "F":  # plain bar: black digits, no patch
            assert label["color"] == "black" and label.get("bbox") is None
        else:  # B, I, W are hatched
            assert label["color"] == "black", kind
            assert label["bbox"]["facecolor"] == "white", kind
