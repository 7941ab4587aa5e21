"""The per-device Gantt chart of a timeline, as a PNG (:func:`draw_timeline`): a row per
device, a bar per action coloured by microbatch (a branched model's by branch) and shaded by
kind, REDUCEs as thin bars along a row's bottom, waits on an interaction message hatched red;
one polygon collection per kind, so 100k bars render in seconds."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..faults import WriteFailed
from ..formats.files import write_aside
from ..formats.timeline import Timeline

# past this many compute bars, drop hatching and edges (they cost time and turn to mush)
DETAIL_LIMIT = 3000
# past this many, do not even try to write microbatch numbers
LABEL_LIMIT = 1500
# The chart can be read while a device's row gives its boxes this many pixels each on
# average, and each row this many pixels of height (see :func:`unreadable`)
MIN_BOX_PX = 2.0
MIN_ROW_PX = 4.0
WIDTH_IN = 14.0
AXES_SHARE = 0.8  # of the figure's width (and about that of its height) the axes take

_KIND_LABELS = {
    "F": "forward (F)",
    "B": "backward (B)",
    "I": "input-grad backward (I)",
    "W": "weight-grad backward (W)",
    "S": "optimizer step (S)",
    "R": "gradient all-reduce (R)",
}
_HATCH = {"B": "////", "I": "\\\\\\\\", "W": "...."}
# branch colours (tab10 blue, orange, purple); further labels take the next ones
BRANCH_COLOURS = {"vision": (0.122, 0.467, 0.706), "text": (1.0, 0.498, 0.055), "head": (0.580, 0.404, 0.741)}
_MORE_COLOURS = [(0.173, 0.627, 0.173), (0.549, 0.337, 0.294), (0.890, 0.467, 0.761), (0.737, 0.741, 0.133),
                 (0.090, 0.745, 0.812)]
WAIT_COLOUR = (0.84, 0.15, 0.16)  # red: nothing else is drawn red
WAIT_LABEL = "waiting on interaction"


def branch_colours(labels) -> dict[str, tuple]:
    """Label -> base colour, for the labels in first-appearance order."""
    out: dict[str, tuple] = {}
    more = iter(_MORE_COLOURS * (1 + len(labels) // len(_MORE_COLOURS)))
    for label in dict.fromkeys(labels):
        out[label] = BRANCH_COLOURS.get(label) or next(more)
    return out


def _shade(rgb, kind: str):
    """Base microbatch colour -> the colour of this kind of action."""
    r, g, b = rgb[:3]
    if kind == "B":
        return (r * 0.6, g * 0.6, b * 0.6)
    if kind == "I":
        return (r * 0.78, g * 0.78, b * 0.78)
    if kind == "W":
        return (r + (1 - r) * 0.55, g + (1 - g) * 0.55, b + (1 - b) * 0.55)
    return (r, g, b)


def _height_in(ndev: int) -> float:
    return min(3.0 + 0.32 * ndev, 40.0)


def unreadable(timeline: Timeline, dpi: int = 110) -> str | None:
    """Why :func:`draw_timeline`'s picture of ``timeline`` could not be read (fewer than
    MIN_BOX_PX pixels of width per compute box on the busiest row, or MIN_ROW_PX of height per
    row), or None when it can; counts only, no matplotlib."""
    devices = timeline.column("device")
    ndev = max(timeline.num_devices, max(devices, default=0) + 1)
    boxes = [0] * ndev
    for d, stream in zip(devices, timeline.column("stream")):
        if stream == "compute":
            boxes[d] += 1
    most = max(boxes, default=0)
    width_px = WIDTH_IN * dpi * AXES_SHARE
    row_px = _height_in(ndev) * dpi * AXES_SHARE / ndev
    if most * MIN_BOX_PX > width_px:
        busiest = boxes.index(most)
        return (f"{most} boxes on device {busiest}'s row of {width_px:.0f} pixels "
                f"(at most {int(width_px // MIN_BOX_PX)} can be told apart)")
    if row_px < MIN_ROW_PX:
        return f"{ndev} device rows of {row_px:.1f} pixels each (at least {MIN_ROW_PX:g} are needed)"
    return None


def draw_timeline(timeline: Timeline, path: str | os.PathLike, title: str | None = None, dpi: int = 110) -> str:
    """Draw ``timeline`` to the PNG file ``path``; returns the path. It draws every box
    whatever the size; :func:`unreadable` says when the picture would be a smear."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    path = os.fspath(path)
    chart = _Chart.of(timeline)
    fig = Figure(figsize=(WIDTH_IN, _height_in(chart.ndev)), dpi=dpi)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    by_kind = _draw_actions(ax, chart)
    if chart.reduces:
        _draw_reduces(ax, chart)
    if chart.waits:
        _draw_interaction_waits(ax, chart)
    if len(chart.compute) <= LABEL_LIMIT:
        _draw_microbatch_numbers(ax, chart, dpi)
    _draw_axes(ax, chart, timeline.time_unit)
    _draw_legend(ax, chart, by_kind)
    ax.set_title(_default_title(timeline, chart) if title is None else title, fontsize=10, loc="left")
    fig.tight_layout()

    parent = os.path.dirname(path)
    try:
        if parent:
            os.makedirs(parent, exist_ok=True)
    except OSError as err:
        raise WriteFailed(path, err) from None
    write_aside(path, lambda f: fig.savefig(f, dpi=dpi, format="png"))  # whole or not at all
    return path


GREY = (0.55, 0.55, 0.55)  # STEP's, and an action of no microbatch


@dataclass
class _Chart:
    """What the parts of a drawing share: the events it draws, the rows and the time axis."""

    ndev: int
    compute: list  # the bars, one per action
    reduces: list  # the all-reduces, along the bottom of their rows
    waits: list  # the idle gaps that waited on an interaction message
    labels: list  # a branched model's branch per stage (empty: coloured by microbatch)
    colour_of_branch: dict
    t0: float
    span: float
    row_top: float  # a bar's top edge in its row (lower with all-reduces: they keep a strip)
    detailed: bool  # few enough bars for hatching and edges

    @classmethod
    def of(cls, timeline: Timeline) -> "_Chart":
        """The chart of ``timeline``: its events by stream and the time they span."""
        ndev = max(timeline.num_devices, max((e.device + 1 for e in timeline.events), default=1))
        compute = [e for e in timeline.events if e.stream == "compute"]
        reduces = [e for e in timeline.events if e.stream == "collective"]
        labels = list(timeline.meta.get("branch") or ())
        waits = [e for e in timeline.events
                 if e.stream == "wait" and e.end > e.start and (e.extra or {}).get("cause_kind") == "interaction"]
        shown = compute + reduces
        t0 = min((e.start for e in shown), default=0.0)
        span = max((e.end for e in shown), default=1.0) - t0
        return cls(ndev, compute, reduces, waits, labels, branch_colours(labels) if labels else {}, t0,
                   span if span > 0 else 1.0, 0.26 if reduces else 0.4, len(compute) <= DETAIL_LIMIT)

    def bars(self, events, y_lo: float, y_hi: float):
        """The corners of each event's box, from ``y_lo`` to ``y_hi`` about its device's row."""
        import numpy as np

        x0 = np.fromiter((e.start - self.t0 for e in events), float, len(events))
        x1 = np.fromiter((e.end - self.t0 for e in events), float, len(events))
        y = np.fromiter((e.device for e in events), float, len(events))
        verts = np.empty((len(events), 4, 2))
        verts[:, 0, 0] = verts[:, 1, 0] = x0
        verts[:, 2, 0] = verts[:, 3, 0] = x1
        verts[:, 0, 1] = verts[:, 3, 1] = y + y_lo
        verts[:, 1, 1] = verts[:, 2, 1] = y + y_hi
        return verts


def _draw_actions(ax, chart: _Chart) -> dict[str, list]:
    """One polygon collection per kind of action, each bar in its microbatch's colour (a
    branched model's: its branch's) shaded by the kind; returns the actions by kind."""
    from matplotlib import colormaps
    from matplotlib.collections import PolyCollection

    # the qualitative palettes without their greys, which belong to STEP
    if max((e.microbatch for e in chart.compute), default=0) < 9:
        palette = [c for i, c in enumerate(colormaps["tab10"].colors) if i != 7]
    else:
        palette = [c for i, c in enumerate(colormaps["tab20"].colors) if i not in (14, 15)]
    labels, by_branch = chart.labels, chart.colour_of_branch
    by_kind: dict[str, list] = {}
    for e in chart.compute:
        by_kind.setdefault(e.kind, []).append(e)
    colour_cache: dict[tuple[str, int], tuple] = {}
    for kind in ("F", "B", "I", "W", "S") + tuple(k for k in by_kind if k not in "FBIWS"):
        events = by_kind.get(kind)
        if not events:
            continue
        faces = []
        for e in events:
            key = (kind, e.stage) if by_branch else (kind, e.microbatch)
            col = colour_cache.get(key)
            if col is None:
                if kind == "S" or e.microbatch < 0:
                    col = GREY
                elif by_branch and 0 <= e.stage < len(labels):
                    col = _shade(by_branch[labels[e.stage]], kind)
                else:
                    col = _shade(palette[e.microbatch % len(palette)], kind)
                colour_cache[key] = col
            faces.append(col)
        coll = PolyCollection(
            chart.bars(events, -0.4, chart.row_top),
            facecolors=faces,
            edgecolors="white" if chart.detailed else "none",
            linewidths=0.4 if chart.detailed else 0.0,
        )
        if chart.detailed and kind in _HATCH:
            coll.set_hatch(_HATCH[kind])
        ax.add_collection(coll)
    return by_kind


def _draw_reduces(ax, chart: _Chart) -> None:
    """The all-reduces: thin black bars in the strip along the bottom of their rows."""
    from matplotlib.collections import PolyCollection

    ax.add_collection(PolyCollection(chart.bars(chart.reduces, chart.row_top + 0.04, 0.42),
                                     facecolors="black", edgecolors="none"))


def _draw_interaction_waits(ax, chart: _Chart) -> None:
    """The idle gaps that waited on an interaction: a thin band across the middle of the gap."""
    from matplotlib.collections import PolyCollection

    mid = (chart.row_top - 0.4) / 2
    hatched = len(chart.waits) <= DETAIL_LIMIT
    band = PolyCollection(
        chart.bars(chart.waits, mid - 0.09, mid + 0.09),
        facecolors=(1.0, 0.88, 0.88) if hatched else WAIT_COLOUR,
        edgecolors=WAIT_COLOUR if hatched else "none",
        linewidths=0.6 if hatched else 0.0,
    )
    if hatched:
        band.set_hatch("xxxx")
    ax.add_collection(band)


def _draw_microbatch_numbers(ax, chart: _Chart, dpi: int) -> None:
    """Each action's microbatch ("<microbatch>.<segment>" for a sequence segment's), where
    its bar is wide enough to hold it."""
    px_per_unit = WIDTH_IN * dpi * AXES_SHARE / chart.span
    fontsize = 7 if chart.ndev <= 16 else 5
    need_px = fontsize * 1.6
    segmented = any(e.segment for e in chart.compute)
    for e in chart.compute:
        if e.microbatch < 0:
            continue
        label = f"{e.microbatch}.{e.segment}" if segmented else str(e.microbatch)
        if (e.end - e.start) * px_per_unit >= need_px * max(1, len(label) * 0.6):
            # on a hatched bar the number sits on a light patch, dark, so the hatch lines
            # do not cross it; unhatched B and I bars are dark enough for white text
            hatched = chart.detailed and e.kind in _HATCH
            colour = "black" if hatched or e.kind not in ("B", "I") else "white"
            patch = dict(boxstyle="round,pad=0.15", facecolor="white", edgecolor="none", alpha=0.85) \
                if hatched else None
            ax.text(
                (e.start + e.end) / 2 - chart.t0, e.device + (chart.row_top - 0.4) / 2, label, ha="center",
                va="center", fontsize=fontsize, color=colour, clip_on=True, bbox=patch,
            )


def _draw_axes(ax, chart: _Chart, time_unit: str) -> None:
    """Time along x, a row per device (device 0 on top, at most 32 named)."""
    ndev = chart.ndev
    ax.set_xlim(0, chart.span * 1.005)
    ax.set_ylim(ndev - 0.5, -0.5)
    step = 1 if ndev <= 32 else -(-ndev // 32)
    ticks = list(range(0, ndev, step))
    ax.set_yticks(ticks)
    ax.set_yticklabels([f"device {d}" for d in ticks], fontsize=8 if ndev <= 16 else 6)
    ax.set_xlabel(f"time ({time_unit})")
    ax.grid(axis="x", linewidth=0.3, alpha=0.5)
    ax.set_axisbelow(True)


def _draw_legend(ax, chart: _Chart, by_kind: dict[str, list]) -> None:
    """Above the chart, right-aligned, opposite the title: the branches shown, the kinds
    drawn, the all-reduces and the interaction waits."""
    from matplotlib import colormaps
    from matplotlib.patches import Patch

    labels = chart.labels
    # with branch colours, the kinds are shown on a neutral sample (the colour is the branch's)
    sample = (0.8, 0.8, 0.8) if chart.colour_of_branch else colormaps["tab10"].colors[0]
    handles = []
    shown_stages = {e.stage for e in chart.compute}
    for label, colour in chart.colour_of_branch.items():
        if any(labels[s] == label for s in shown_stages if 0 <= s < len(labels)):
            handles.append(Patch(facecolor=colour, edgecolor="white", label=label))
    for kind in ("F", "B", "I", "W", "S"):
        if kind in by_kind:
            face = GREY if kind == "S" else _shade(sample, kind)
            handles.append(Patch(facecolor=face, edgecolor="white", hatch=_HATCH.get(kind), label=_KIND_LABELS[kind]))
    if chart.reduces:
        handles.append(Patch(facecolor="black", label=_KIND_LABELS["R"]))
    if chart.waits:
        handles.append(Patch(facecolor=(1.0, 0.88, 0.88), edgecolor=WAIT_COLOUR, hatch="xxxx", label=WAIT_LABEL))
    if handles:
        ncol = len(handles) if len(handles) <= 6 else -(-len(handles) // 2)
        ax.legend(handles=handles, loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=ncol,
                  fontsize=8, frameon=False, borderaxespad=0.2)


def _default_title(timeline: Timeline, chart: _Chart) -> str:
    """The schedule, its devices and microbatches, the bubble and the makespan drawn."""
    meta = timeline.meta
    parts = [str(meta.get("schedule", "timeline")), f"{chart.ndev} devices"]
    if "num_microbatches" in meta:
        parts.append(f"{meta['num_microbatches']} microbatches")
    if "bubble_ratio" in meta:
        parts.append(f"bubble {meta['bubble_ratio']:.1%}")
    parts.append(f"makespan {chart.span:.4g} {timeline.time_unit}")
    if timeline.source != "simulated":
        parts.append(timeline.source)
    return ", ".join(parts)
