"""The per-device Gantt chart researchers put in their papers, as a PNG.

One row per device (device 0 on top), one bar per action, colour per microbatch;
the kind shows in the shading: F plain, B darker and hatched, I darker and hatched the
other way, W light and dotted, STEP grey; a REDUCE is a thin black bar along the bottom
of its row (it runs beside the compute stream, not on it). Transfers are not drawn.

Everything is drawn as one polygon collection per kind, so a 64-device x 1024-microbatch
timeline (over 100k bars) still renders in seconds; hatching, bar edges and microbatch
numbers are only added when there are few enough bars to see them.
"""

from __future__ import annotations

import os

from .timeline import Timeline

# past this many compute bars, drop hatching and edges (they cost time and turn to mush)
DETAIL_LIMIT = 3000
# past this many, do not even try to write microbatch numbers
LABEL_LIMIT = 1500

_KIND_LABELS = {
    "F": "forward (F)",
    "B": "backward (B)",
    "I": "input-grad backward (I)",
    "W": "weight-grad backward (W)",
    "S": "optimizer step (S)",
    "R": "gradient all-reduce (R)",
}
_HATCH = {"B": "////", "I": "\\\\\\\\", "W": "...."}


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


def draw_timeline(timeline: Timeline, path: str | os.PathLike, title: str | None = None, dpi: int = 110) -> str:
    """Draw ``timeline`` to the PNG file ``path``; returns the path."""
    import numpy as np
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.collections import PolyCollection
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    path = os.fspath(path)
    ndev = max(timeline.num_devices, max((e.device + 1 for e in timeline.events), default=1))
    compute = [e for e in timeline.events if e.stream == "compute"]
    reduces = [e for e in timeline.events if e.stream == "collective"]
    shown = compute + reduces
    t0 = min((e.start for e in shown), default=0.0)
    span = max((e.end for e in shown), default=1.0) - t0
    if span <= 0:
        span = 1.0

    width_in = 14.0
    height_in = min(3.0 + 0.32 * ndev, 40.0)
    fig = Figure(figsize=(width_in, height_in), dpi=dpi)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    detailed = len(compute) <= DETAIL_LIMIT

    # the qualitative palettes without their greys, which belong to STEP
    if max((e.microbatch for e in compute), default=0) < 9:
        palette = [c for i, c in enumerate(colormaps["tab10"].colors) if i != 7]
    else:
        palette = [c for i, c in enumerate(colormaps["tab20"].colors) if i not in (14, 15)]
    grey = (0.55, 0.55, 0.55)

    def bars(events, y_lo, y_hi):
        x0 = np.fromiter((e.start - t0 for e in events), float, len(events))
        x1 = np.fromiter((e.end - t0 for e in events), float, len(events))
        y = np.fromiter((e.device for e in events), float, len(events))
        verts = np.empty((len(events), 4, 2))
        verts[:, 0, 0] = verts[:, 1, 0] = x0
        verts[:, 2, 0] = verts[:, 3, 0] = x1
        verts[:, 0, 1] = verts[:, 3, 1] = y + y_lo
        verts[:, 1, 1] = verts[:, 2, 1] = y + y_hi
        return verts

    # with all-reduces, each row keeps a strip at its bottom for them
    row_top = 0.26 if reduces else 0.4
    by_kind: dict[str, list] = {}
    for e in compute:
        by_kind.setdefault(e.kind, []).append(e)
    colour_cache: dict[tuple[str, int], tuple] = {}
    for kind in ("F", "B", "I", "W", "S") + tuple(k for k in by_kind if k not in "FBIWS"):
        events = by_kind.get(kind)
        if not events:
            continue
        faces = []
        for e in events:
            key = (kind, e.microbatch)
            col = colour_cache.get(key)
            if col is None:
                if kind == "S" or e.microbatch < 0:
                    col = grey
                else:
                    col = _shade(palette[e.microbatch % len(palette)], kind)
                colour_cache[key] = col
            faces.append(col)
        coll = PolyCollection(
            bars(events, -0.4, row_top),
            facecolors=faces,
            edgecolors="white" if detailed else "none",
            linewidths=0.4 if detailed else 0.0,
        )
        if detailed and kind in _HATCH:
            coll.set_hatch(_HATCH[kind])
        ax.add_collection(coll)

    if reduces:
        ax.add_collection(PolyCollection(bars(reduces, row_top + 0.04, 0.42), facecolors="black", edgecolors="none"))

    # microbatch numbers, where a bar is wide enough to hold them
    if len(compute) <= LABEL_LIMIT:
        axes_px = width_in * dpi * 0.8
        px_per_unit = axes_px / span
        fontsize = 7 if ndev <= 16 else 5
        need_px = fontsize * 1.6
        for e in compute:
            if e.microbatch < 0:
                continue
            label = str(e.microbatch)
            if (e.end - e.start) * px_per_unit >= need_px * max(1, len(label) * 0.6):
                colour = "white" if e.kind in ("B", "I") else "black"
                ax.text(
                    (e.start + e.end) / 2 - t0, e.device + (row_top - 0.4) / 2, label, ha="center", va="center",
                    fontsize=fontsize, color=colour, clip_on=True,
                )

    ax.set_xlim(0, span * 1.005)
    ax.set_ylim(ndev - 0.5, -0.5)  # device 0 on top
    step = 1 if ndev <= 32 else -(-ndev // 32)
    ticks = list(range(0, ndev, step))
    ax.set_yticks(ticks)
    ax.set_yticklabels([f"device {d}" for d in ticks], fontsize=8 if ndev <= 16 else 6)
    ax.set_xlabel(f"time ({timeline.time_unit})")
    ax.grid(axis="x", linewidth=0.3, alpha=0.5)
    ax.set_axisbelow(True)

    sample = colormaps["tab10"].colors[0]
    handles = []
    for kind in ("F", "B", "I", "W", "S"):
        if kind in by_kind:
            face = grey if kind == "S" else _shade(sample, kind)
            handles.append(Patch(facecolor=face, edgecolor="white", hatch=_HATCH.get(kind), label=_KIND_LABELS[kind]))
    if reduces:
        handles.append(Patch(facecolor="black", label=_KIND_LABELS["R"]))
    if handles:  # above the chart, right-aligned, opposite the title
        ax.legend(handles=handles, loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=len(handles),
                  fontsize=8, frameon=False, borderaxespad=0.2)

    if title is None:
        meta = timeline.meta
        parts = [str(meta.get("schedule", "timeline")), f"{ndev} devices"]
        if "num_microbatches" in meta:
            parts.append(f"{meta['num_microbatches']} microbatches")
        if "bubble_ratio" in meta:
            parts.append(f"bubble {meta['bubble_ratio']:.1%}")
        parts.append(f"makespan {span:.4g} {timeline.time_unit}")
        if timeline.source != "simulated":
            parts.append(timeline.source)
        title = ", ".join(parts)
    ax.set_title(title, fontsize=10, loc="left")
    fig.tight_layout()

    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    return path
