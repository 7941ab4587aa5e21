"""One timeline format for simulated and measured runs.

The simulator writes a :class:`Timeline`; the runtime will record its measured action
start/end times into the same class, so predicted and measured runs can be compared
event by event, exported the same way (Chrome trace JSON, which Perfetto and
chrome://tracing open) and drawn the same way (:mod:`pipeflow.sim.gantt`).

An :class:`Event` is one interval on one stream of one device:

- ``compute``: an F, B, I, W or STEP action on the device's compute stream;
- ``collective``: a REDUCE (all-reduce of a replicated stage's gradients), one event
  per participating device;
- ``comm``: a point-to-point transfer of an activation or gradient; it sits on the
  sending device, ``src``/``dst`` are the devices and ``nbytes`` the payload, and it
  spans from the moment the transfer got its links to its arrival;
- ``wait``: an idle gap of the compute stream and what ended it (simulations of
  branched models): named ``"wait <action>"`` after the action that waited (``"drain"``
  after the device's last action), ``src`` the device of the cause, and ``extra`` holding
  ``cause_kind`` (interaction, head, chain, reduce, stream, drain), ``cause`` (the
  action that resolved last), ``cause_device`` and ``message``.

The Chrome-trace export is lossless: every field of every event is kept in the event's
``args`` and the timeline's own fields in ``otherData``, so ``Timeline.load`` reads back
exactly what ``save`` wrote (times are stored as exact floats, not only as the rounded
microsecond ``ts``/``dur`` the viewers use).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Iterable, Iterator

FORMAT = "pipeflow.timeline/1"
STREAMS = ("compute", "wait", "collective", "comm")
SOURCES = ("simulated", "measured")
# Chrome traces count in microseconds; this converts one timeline unit into them.
# "units" are a unit-cost model's abstract time; traces show one unit as one second
_US_PER_UNIT = {"s": 1e6, "ms": 1e3, "us": 1.0, "units": 1e6}


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


# The names of Event's fields that travel in a Chrome event's "args".
_ARG_FIELDS = ("kind", "stage", "microbatch", "pipe", "segment", "stream", "src", "dst", "nbytes", "version")


@dataclass
class Timeline:
    """Events of one run (one iteration, or whatever the producer recorded).

    ``time_unit`` is the unit of ``start``/``end``: "s", "ms", "us", or "units" for
    simulations with unit costs (one unit is drawn as one second in Chrome traces). ``source`` says whether
    the times were predicted ("simulated") or observed ("measured").
    """

    events: list[Event]
    num_devices: int
    time_unit: str = "s"
    source: str = "simulated"
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.time_unit not in _US_PER_UNIT:
            raise ValueError(
                f"timeline time_unit={self.time_unit!r} is not supported; use one of {', '.join(_US_PER_UNIT)}"
            )
        if self.source not in SOURCES:
            raise ValueError(f"timeline source={self.source!r} is not supported; use one of {', '.join(SOURCES)}")

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

    # ------------------------------------------------------------ chrome trace
    def to_chrome_trace(self) -> dict:
        """Chrome trace / Perfetto JSON (object form).

        One process per device ("device N"); one thread per stream lane. Compute and
        collective streams never overlap themselves in a simulation, but transfers
        (and measured events) can, and the viewers nest "X" events of one thread, so
        partial overlaps would be drawn wrong: each stream is split greedily into as
        many lanes as it needs ("comm", "comm 2", ...).
        """
        scale = _US_PER_UNIT[self.time_unit]
        trace: list[dict] = []
        devices = sorted({e.device for e in self.events} | set(range(self.num_devices)))
        for d in devices:
            trace.append({"name": "process_name", "ph": "M", "pid": d, "tid": 0, "args": {"name": f"device {d}"}})
            trace.append({"name": "process_sort_index", "ph": "M", "pid": d, "tid": 0, "args": {"sort_index": d}})

        # lanes[(device, stream)] = end time of the last event in each lane
        lanes: dict[tuple[int, str], list[float]] = {}
        order = sorted(range(len(self.events)), key=lambda i: (self.events[i].start, i))
        lane_of = [0] * len(self.events)
        for i in order:
            e = self.events[i]
            ends = lanes.setdefault((e.device, e.stream), [])
            for k, last in enumerate(ends):
                if last <= e.start:
                    ends[k] = e.end
                    lane_of[i] = k
                    break
            else:
                ends.append(e.end)
                lane_of[i] = len(ends) - 1

        # tids: the streams in a fixed order (compute on top), then lanes within a stream
        tid_of: dict[tuple[int, str, int], int] = {}
        next_tid: dict[int, int] = {}
        rank = {s: r for r, s in enumerate(STREAMS)}
        for (d, stream), ends in sorted(lanes.items(), key=lambda kv: (kv[0][0], rank.get(kv[0][1], 99), kv[0][1])):
            for k in range(len(ends)):
                tid = next_tid.get(d, 0)
                next_tid[d] = tid + 1
                tid_of[(d, stream, k)] = tid
                label = stream if k == 0 else f"{stream} {k + 1}"
                trace.append({"name": "thread_name", "ph": "M", "pid": d, "tid": tid, "args": {"name": label}})
                trace.append({"name": "thread_sort_index", "ph": "M", "pid": d, "tid": tid, "args": {"sort_index": tid}})

        for i, e in enumerate(self.events):
            args = {f: getattr(e, f) for f in _ARG_FIELDS}
            args["start"] = e.start  # exact, for a lossless round trip
            args["end"] = e.end
            if e.extra:
                args["extra"] = e.extra
                if e.stream == "wait":  # the cause at the top of args, where the viewers show it
                    for k, v in e.extra.items():
                        args.setdefault(k, v)
            trace.append(
                {
                    "name": e.name,
                    "cat": e.stream if e.stream != "compute" else e.kind,
                    "ph": "X",
                    "pid": e.device,
                    "tid": tid_of[(e.device, e.stream, lane_of[i])],
                    "ts": e.start * scale,
                    "dur": (e.end - e.start) * scale,
                    "args": args,
                }
            )
        return {
            "traceEvents": trace,
            "displayTimeUnit": "ms",
            "otherData": {
                "format": FORMAT,
                "num_devices": self.num_devices,
                "time_unit": self.time_unit,
                "source": self.source,
                "meta": self.meta,
            },
        }

    @classmethod
    def from_chrome_trace(cls, trace: dict) -> "Timeline":
        """Inverse of :meth:`to_chrome_trace`.

        A trace written by another tool is read as well as it can be: each "X" event
        becomes an event on device ``pid`` with its thread's name as the stream (when
        it is one of compute/wait/collective/comm) and ``ts``/``dur`` in microseconds.
        """
        if isinstance(trace, list):  # the bare-array form of the format
            trace = {"traceEvents": trace}
        if "traceEvents" not in trace:
            raise ValueError("not a Chrome trace: expected a JSON object with a 'traceEvents' list")
        other = trace.get("otherData") or {}
        ours = other.get("format") == FORMAT
        unit = other.get("time_unit", "s") if ours else "us"
        scale = _US_PER_UNIT.get(unit, 1.0)
        thread_names: dict[tuple[int, int], str] = {}
        for ev in trace["traceEvents"]:
            if ev.get("ph") == "M" and ev.get("name") == "thread_name":
                thread_names[(ev.get("pid", 0), ev.get("tid", 0))] = ev.get("args", {}).get("name", "")
        events: list[Event] = []
        for ev in trace["traceEvents"]:
            if ev.get("ph") != "X":
                continue
            args = ev.get("args") or {}
            device = int(ev.get("pid", 0))
            if "start" in args and "end" in args:
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

    def save(self, path: str | os.PathLike) -> str:
        """Write the Chrome-trace JSON (open it in https://ui.perfetto.dev)."""
        path = os.fspath(path)
        parent = os.path.dirname(path)
        if parent:
            os.makedirs(parent, exist_ok=True)
        with open(path, "w") as fh:
            json.dump(self.to_chrome_trace(), fh, separators=(",", ":"))
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Timeline":
        with open(path) as fh:
            try:
                data = json.load(fh)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{os.fspath(path)} is not a JSON timeline ({exc})") from exc
        return cls.from_chrome_trace(data)

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
