"""One timeline format for simulated and measured runs (:class:`Timeline` of :class:`Event`).

An event's ``stream``: ``compute`` (an F, B, I, W or STEP action), ``collective`` (a
REDUCE, one event per device), ``comm`` (a transfer, on the sender: ``src``/``dst``,
``nbytes``, from getting its links to arrival) or ``wait`` (an idle gap of a branched
model's compute stream, ``"wait <action>"``; ``extra``: ``cause_kind``, ``cause``,
``cause_device``, ``message``). Saved as a lossless Chrome trace
(:mod:`pipeflow.formats.trace`; docs/simulation.md, "Large runs")."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Iterable, Iterator

from .trace import (FIELDS, FORMAT, STREAMS, US_PER_UNIT, exact_times, read_trace, trace_pieces, write_trace,
                    write_trace_beside)
from .trace import timeline_file  # noqa: F401 - the readers' way to a run folder's timeline, plain or gzipped

SOURCES = ("simulated", "measured")


@dataclass(slots=True)
class Event:
    """One interval on one device's stream. Field order is the constructor's order."""

    device: int
    name: str  # action notation, e.g. "0F3", "1:2B0s1", "4R@0"; "0F3->1F3" for a transfer
    kind: str  # F, B, I, W, R, S; for a transfer, the kind of the action that produced it
    stage: int
    microbatch: int
    pipe: int
    segment: int
    start: float
    end: float
    stream: str = "compute"
    src: int = -1  # transfers: sending and receiving device
    dst: int = -1
    nbytes: float = 0.0  # transfers: payload; collectives: gradient bytes reduced
    version: int = -1  # REDUCE / STEP: the weight update they belong to
    extra: dict | None = None  # anything else a producer wants to keep (JSON-able)

    @property
    def duration(self) -> float:
        return self.end - self.start

    def to_dict(self) -> dict:
        d = {
            "device": self.device,
            "name": self.name,
            "kind": self.kind,
            "stage": self.stage,
            "microbatch": self.microbatch,
            "pipe": self.pipe,
            "segment": self.segment,
            "start": self.start,
            "end": self.end,
            "stream": self.stream,
            "src": self.src,
            "dst": self.dst,
            "nbytes": self.nbytes,
            "version": self.version,
        }
        if self.extra:
            d["extra"] = self.extra
        return d


@dataclass(eq=False)
class Timeline:
    """Events of one run (one iteration, or whatever the producer recorded).

    ``time_unit``: the unit of ``start``/``end``, "s", "ms", "us" or "units" (unit costs;
    drawn as seconds); ``source``: "simulated" or "measured"."""

    events: list[Event]
    num_devices: int
    time_unit: str = "s"
    source: str = "simulated"
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.time_unit not in US_PER_UNIT:
            raise ValueError(
                f"timeline time_unit={self.time_unit!r} is not supported; use one of {', '.join(US_PER_UNIT)}"
            )
        if self.source not in SOURCES:
            raise ValueError(f"timeline source={self.source!r} is not supported; use one of {', '.join(SOURCES)}")

    @classmethod
    def from_columns(cls, columns: dict[str, list], num_devices: int, time_unit: str = "s",
                     source: str = "simulated", meta: dict | None = None) -> "Timeline":
        """A timeline of the events in ``columns`` (one equal-length list per Event field); the
        Event objects are made only when ``events`` is first read (:meth:`save` and
        :meth:`column` read the columns)."""
        return _ColumnTimeline(None, num_devices, time_unit, source, {} if meta is None else meta, columns=columns)

    def __eq__(self, other) -> bool:
        if not isinstance(other, Timeline):
            return NotImplemented
        return (self.events, self.num_devices, self.time_unit, self.source, self.meta) == (
            other.events, other.num_devices, other.time_unit, other.source, other.meta)

    __hash__ = None  # mutable, compared by value

    # ------------------------------------------------------------------ queries
    def __len__(self) -> int:
        return len(self.events)

    def __iter__(self) -> Iterator[Event]:
        return iter(self.events)

    @property
    def makespan(self) -> float:
        """From the earliest start to the latest end (0 for an empty timeline)."""
        if not self.events:
            return 0.0
        return max(e.end for e in self.events) - min(e.start for e in self.events)

    def select(self, stream: str | None = None, device: int | None = None, kind: str | None = None) -> list[Event]:
        return [
            e
            for e in self.events
            if (stream is None or e.stream == stream)
            and (device is None or e.device == device)
            and (kind is None or e.kind == kind)
        ]

    def busy(self) -> list[float]:
        """Compute-stream busy time per device."""
        out = [0.0] * self.num_devices
        for e in self.events:
            if e.stream == "compute":
                out[e.device] += e.end - e.start
        return out

    def by_name(self, stream: str = "compute") -> dict[tuple[int, str], Event]:
        """(device, name) -> event; the key for matching predicted and measured runs."""
        return {(e.device, e.name): e for e in self.events if e.stream == stream}

    def column(self, name: str) -> list:
        """One field of every event, in order (``name`` one of Event's fields)."""
        return list(map(attrgetter(name), self.events))

    # ------------------------------------------------------------ chrome trace
    def to_chrome_trace(self) -> dict:
        """Chrome trace / Perfetto JSON (object form), what :meth:`save` writes, parsed: one process
        per device, one thread per stream lane (a stream whose events overlap is split into
        lanes: "comm", "comm 2", ...)."""
        return json.loads("".join(self._trace_pieces()))

    def _trace_pieces(self) -> Iterator[str]:
        return trace_pieces(self._field_columns(), self.num_devices, self.time_unit, self.source, self.meta)

    def _field_columns(self) -> dict[str, list]:
        """Every field of every event, one list per name of FIELDS, for reading only."""
        return {name: self.column(name) for name in FIELDS}

    @classmethod
    def from_chrome_trace(cls, trace: dict) -> "Timeline":
        """Inverse of :meth:`to_chrome_trace`. Another tool's trace is read as well as it can be:
        each "X" event on device ``pid``, its thread's name as the stream, ``ts``/``dur`` in µs."""
        if isinstance(trace, list):  # the bare-array form of the format
            trace = {"traceEvents": trace}
        if "traceEvents" not in trace:
            raise ValueError("not a Chrome trace: expected a JSON object with a 'traceEvents' list")
        other = trace.get("otherData") or {}
        ours = other.get("format") == FORMAT
        unit = other.get("time_unit", "s") if ours else "us"
        scale = US_PER_UNIT.get(unit, 1.0)
        thread_names: dict[tuple[int, int], str] = {}
        for ev in trace["traceEvents"]:
            if ev.get("ph") == "M" and ev.get("name") == "thread_name":
                thread_names[(ev.get("pid", 0), ev.get("tid", 0))] = ev.get("args", {}).get("name", "")
        xs = [ev for ev in trace["traceEvents"] if ev.get("ph") == "X"]
        # exact times: the trace's exactTimes (what save writes), else each event's args
        # (what earlier versions wrote), else ts and dur
        exact = exact_times(trace) if ours else None
        if exact is not None and not len(exact[0]) == len(exact[1]) == len(xs):
            exact = None
        events: list[Event] = []
        for i, ev in enumerate(xs):
            args = ev.get("args") or {}
            device = int(ev.get("pid", 0))
            if exact is not None:
                start, end = exact[0][i], exact[1][i]
            elif "start" in args and "end" in args:
                start, end = float(args["start"]), float(args["end"])
            else:
                start = float(ev.get("ts", 0.0)) / scale
                end = start + float(ev.get("dur", 0.0)) / scale
            stream = args.get("stream")
            if stream is None:
                label = thread_names.get((device, ev.get("tid", 0)), "").split(" ")[0]
                stream = label if label in STREAMS else "compute"
            events.append(
                Event(
                    device=device,
                    name=str(ev.get("name", "")),
                    kind=str(args.get("kind", ev.get("cat", ""))),
                    stage=int(args.get("stage", -1)),
                    microbatch=int(args.get("microbatch", -1)),
                    pipe=int(args.get("pipe", 0)),
                    segment=int(args.get("segment", 0)),
                    start=start,
                    end=end,
                    stream=stream,
                    src=int(args.get("src", -1)),
                    dst=int(args.get("dst", -1)),
                    nbytes=float(args.get("nbytes", 0.0)),
                    version=int(args.get("version", -1)),
                    extra=args.get("extra"),
                )
            )
        num_devices = int(other.get("num_devices", 0)) or (max((e.device for e in events), default=-1) + 1)
        return cls(
            events=events,
            num_devices=num_devices,
            time_unit=unit,
            source=other.get("source", "measured") if ours else "measured",
            meta=dict(other.get("meta") or {}),
        )

    def save(self, path: str | os.PathLike, compress: bool | None = False) -> str:
        """Write the Chrome-trace JSON; return the path. ``compress``: False plain at ``path``,
        True gzipped at ``path`` + ".gz", None gzipped when longer than
        :data:`pipeflow.formats.trace.COMPRESS_ABOVE` (a ".gz" path always is); the other
        form, if left beside by an earlier save, is removed."""
        return write_trace(path, self._trace_pieces(), compress)

    def save_beside(self, path: str | os.PathLike, compress: bool | None = False):
        """:meth:`save` on a thread of its own (:func:`~pipeflow.formats.trace.write_trace_beside`):
        a future whose result is the path."""
        return write_trace_beside(path, self._trace_pieces(), compress)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Timeline":
        """Read what :meth:`save` wrote (or another tool's Chrome trace), plain or gzipped; ``path``
        may name the plain file when only the gzipped one exists, or a run folder."""
        return cls.from_chrome_trace(read_trace(path))

    @classmethod
    def merge(cls, timelines: Iterable["Timeline"]) -> "Timeline":
        """Concatenate timelines of the same run (e.g. one per rank from the runtime)."""
        tls = list(timelines)
        if not tls:
            raise ValueError("merge needs at least one timeline")
        units = {t.time_unit for t in tls}
        if len(units) != 1:
            raise ValueError(f"cannot merge timelines with different time units: {sorted(units)}")
        meta: dict = {}
        for t in tls:
            meta.update(t.meta)
        return cls(
            events=[e for t in tls for e in t.events],
            num_devices=max(t.num_devices for t in tls),
            time_unit=tls[0].time_unit,
            source=tls[0].source,
            meta=meta,
        )


class _ColumnTimeline(Timeline):
    """A :class:`Timeline` held as columns until its events are first read
    (:meth:`Timeline.from_columns`); from then on it is an ordinary one."""

    def __init__(self, events: list[Event] | None = None, num_devices: int = 0, time_unit: str = "s",
                 source: str = "simulated", meta: dict | None = None, columns: dict[str, list] | None = None):
        # Timeline's own arguments first, so that dataclasses.replace makes one (of events)
        if events is None and columns is None:
            events = []
        if columns is not None and len({len(columns[name]) for name in FIELDS}) != 1:
            lengths = sorted({len(columns[name]) for name in FIELDS})
            raise ValueError(f"timeline columns of different lengths: {lengths}")
        self._columns: dict[str, list] | None = columns if events is None else None
        self._events: list[Event] | None = None
        super().__init__(events, num_devices, time_unit, source, {} if meta is None else meta)

    @property
    def events(self) -> list[Event]:
        if self._events is None:
            c = self._columns
            self._events = list(map(Event, *(c[name] for name in FIELDS)))
            self._columns = None  # the events are the truth now: whoever holds them may change them
        return self._events

    @events.setter
    def events(self, events: list[Event] | None) -> None:
        if events is not None:
            self._events, self._columns = events, None

    def column(self, name: str) -> list:
        if self._columns is None:
            return super().column(name)
        return list(self._columns[name])

    def _field_columns(self) -> dict[str, list]:
        return super()._field_columns() if self._columns is None else self._columns
