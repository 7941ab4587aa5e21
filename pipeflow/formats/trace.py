"""The Chrome trace of a timeline, as text, written fast; read back from either form.

:class:`pipeflow.formats.timeline.Timeline` saves and loads through here. The text is made
column by column with string formatting (json's encoder spends seconds on 64 x 1024
microbatches). The layout: ``displayTimeUnit`` and ``otherData`` (the timeline's fields)
first; ``traceEvents``, one process per device, one thread per stream lane, one "X" record
per event (``ts``/``dur`` µs cut to whole nanoseconds; in ``args`` every field that differs
from its default); ``exactTimes`` last, the exact starts and ends as byte-shuffled float64
in base64. A text over :data:`COMPRESS_ABOVE` can be written gzipped."""

from __future__ import annotations

import base64
import gzip
import json
import math
import os
import sys
import threading
import zlib
from array import array
from concurrent.futures import Future
from itertools import chain, groupby, islice, repeat
from json.encoder import encode_basestring_ascii as _quote
from operator import sub, truediv
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from ..faults import WriteFailed
from .files import write_aside

FORMAT = "pipeflow.timeline/1"
STREAMS = ("compute", "wait", "collective", "comm")
# Chrome traces count in microseconds; this converts one timeline unit into them.
# "units" are a unit-cost model's abstract time; traces show one unit as one second
US_PER_UNIT = {"s": 1e6, "ms": 1e3, "us": 1.0, "units": 1e6}
# Event's fields, in its constructor's order: the columns a trace is made from
FIELDS = ("device", "name", "kind", "stage", "microbatch", "pipe", "segment", "start", "end", "stream", "src", "dst",
          "nbytes", "version", "extra")
# the names in an X record's args that are an event's fields (those written and the
# defaults left out) or its times: a wait event's extra keys never go over them
ARG_NAMES = frozenset(FIELDS[2:])

# save(compress=None) gzips a trace whose JSON text is longer than this (a 64 x 1024
# simulation writes 45 MB of text, 9 MB gzipped); below it the plain file is written
COMPRESS_ABOVE = 16 * 2**20
GZIP_LEVEL = 1  # gzip's fastest: 45 MB in 0.2 s; level 6 takes nearly three times as long
_GZIP_MAGIC = b"\x1f\x8b"
_TIMES = "base64 float64 little-endian shuffled"  # see the module's docstring


# --------------------------------------------------------------------------- writing
def trace_pieces(columns: dict[str, list], num_devices: int, time_unit: str, source: str, meta: dict,
                 chunk: int = 8192) -> Iterator[str]:
    """The Chrome trace of the events in ``columns`` (one list per name of FIELDS) as
    JSON text, in pieces of ``chunk`` events: join them, or write them as they come."""
    scale = US_PER_UNIT[time_unit]
    starts, ends = np.array(columns["start"], dtype=np.float64), np.array(columns["end"], dtype=np.float64)
    devices, streams, kinds = columns["device"], columns["stream"], columns["kind"]
    tids, threads = lanes(devices, streams, starts, ends)
    q = _quote
    meta_records = []
    for d in sorted(set(devices) | set(range(num_devices))):
        meta_records += ['{"name":"process_name","ph":"M","pid":%d,"tid":0,"args":{"name":"device %d"}}' % (d, d),
                         '{"name":"process_sort_index","ph":"M","pid":%d,"tid":0,"args":{"sort_index":%d}}' % (d, d)]
    for d, label, tid in threads:
        meta_records += ['{"name":"thread_name","ph":"M","pid":%d,"tid":%d,"args":{"name":%s}}' % (d, tid, q(label)),
                         '{"name":"thread_sort_index","ph":"M","pid":%d,"tid":%d,"args":{"sort_index":%d}}'
                         % (d, tid, tid)]
    other = {"format": FORMAT, "num_devices": num_devices, "time_unit": time_unit, "source": source, "meta": meta}
    yield '{"displayTimeUnit":"ms","otherData":' + _json(other) + ',"traceEvents":[' + ",".join(meta_records)

    finite = bool(np.isfinite(starts).all() and np.isfinite(ends).all())
    names = columns["name"]
    plain = _plain("".join(names))  # action names need nothing escaped, which one look tells
    # Texts that repeat are written once per distinct value and looked up: from the
    # category to the thread (the category: a compute event's kind, else its stream), and
    # the tail of args, every field that differs from an Event's default (a stream in
    # STREAMS is its thread's name)
    head = _column(zip(streams, kinds, devices, tids), _head)
    tail = _column(zip(streams, kinds, columns["pipe"], columns["segment"], columns["src"], columns["dst"],
                       columns["nbytes"], columns["version"]), _tail)
    ts, dur = _viewer_times(starts, ends, scale, finite)
    if finite:  # (a few durations make most events: one per kind of action and stage)
        dur = _column(dur, "%.3f".__mod__)
    cols = [
        names if plain else list(map(q, names)),  # (quoted as json quotes them)
        head,
        ts,
        dur,
        columns["stage"],
        columns["microbatch"],
        tail,
    ]
    extras = columns["extra"]
    if any(extras):
        cols.append(["" if not x else _extra_args(s, x) for s, x in zip(streams, extras)])
    record = ('{"name":' + ('"%s"' if plain else "%s") + "%s" + ("%.3f" if finite else "%s") + ',"dur":%s' +
              ',"args":{"stage":%d,"microbatch":%d%s' + "%s" * (len(cols) - 7) + "}}").__mod__
    rows = zip(*cols)
    for lo in range(0, len(starts), chunk):
        text = ",".join(map(record, islice(rows, chunk)))
        yield "," + text if lo or meta_records else text
    # (json.dumps' text: base64 needs no escaping)
    yield '],"exactTimes":{"encoding":"%s","start":"%s","end":"%s"}}' % (_TIMES, _pack(starts), _pack(ends))


def lanes(devices: list[int], streams: list[str], starts: np.ndarray, ends: np.ndarray
          ) -> tuple[list[int], list[tuple]]:
    """The Chrome thread of every event, and the threads as (device, label, tid). A (device,
    stream) whose events start in order and never overlap is one lane; any other is split
    greedily (each event takes the first lane free by its start). Tids follow STREAMS order."""
    stream_id = {s: i for i, s in enumerate(dict.fromkeys(streams))}
    width, name_of = len(stream_id), list(stream_id)
    # one int per (device, stream); a stable sort keeps each group in list order
    codes = (np.array(devices, dtype=np.int64) * width
             + np.fromiter(map(stream_id.__getitem__, streams), dtype=np.int64, count=len(streams)))
    order = np.argsort(codes, kind="stable")
    c, s, e = codes[order], starts[order], ends[order]
    num_lanes = dict.fromkeys(c[np.r_[True, c[1:] != c[:-1]]].tolist() if len(c) else [], 1)
    # where the next event is of the same group, it starts at or after this one's start and end
    if np.all((c[:-1] != c[1:]) | ((s[:-1] <= s[1:]) & (e[:-1] <= s[1:]))):
        lane_of = np.zeros(len(codes), dtype=np.int64)
    else:
        lane_of = _greedy_lanes(order.tolist(), codes.tolist(), starts.tolist(), ends.tolist(), num_lanes)
    rank = {s: r for r, s in enumerate(STREAMS)}
    threads: list[tuple[int, str, int]] = []
    first_tid = [0] * (int(codes.max(initial=-1)) + 1)
    next_tid: dict[int, int] = {}
    by_device = sorted(num_lanes, key=lambda code: (code // width, rank.get(name_of[code % width], 99),
                                                    name_of[code % width]))
    for code in by_device:
        d, stream, n = code // width, name_of[code % width], num_lanes[code]
        tid = first_tid[code] = next_tid.get(d, 0)
        next_tid[d] = tid + n
        threads += [(d, stream if k == 0 else f"{stream} {k + 1}", tid + k) for k in range(n)]
    return (np.array(first_tid, dtype=np.int64)[codes] + lane_of).tolist(), threads


def _greedy_lanes(order: list[int], codes: list[int], starts: list[float], ends: list[float],
                  num_lanes: dict[int, int]) -> np.ndarray:
    """Each event's lane where some (device, stream) needs several (``order``: the events
    grouped by code, each group in list order); ``num_lanes`` gets each group's count."""
    lane_of = [0] * len(codes)
    for code, members in groupby(order, key=codes.__getitem__):
        free_at: list[float] = []  # per lane, the end of its last event
        for i in sorted(members, key=starts.__getitem__):  # stable: ties stay in list order
            start = starts[i]
            for k, t in enumerate(free_at):
                if t <= start:
                    free_at[k] = ends[i]
                    lane_of[i] = k
                    break
            else:
                lane_of[i] = len(free_at)
                free_at.append(ends[i])
        num_lanes[code] = len(free_at)
    return np.array(lane_of, dtype=np.int64)


def write_trace(path: str | os.PathLike, pieces: Iterable[str], compress: bool | None = False) -> str:
    """Write the text ``pieces`` to ``path``; return the path written. ``compress`` as
    :meth:`pipeflow.formats.timeline.Timeline.save`'s; the other form, if beside, is removed."""
    path = os.fspath(path)
    plain = path[:-3] if path.endswith(".gz") else path
    if path.endswith(".gz"):
        compress = True
    pieces = iter(pieces)
    held: list[str] = []  # with compress=None, the text until its size decides
    if compress is None:
        size = 0
        for piece in pieces:
            held.append(piece)
            size += len(piece)
            if size > COMPRESS_ABOVE:
                break
        compress = size > COMPRESS_ABOVE
    path = plain + ".gz" if compress else plain
    parent = os.path.dirname(path)
    try:
        if parent:
            os.makedirs(parent, exist_ok=True)
    except OSError as err:
        raise WriteFailed(path, err) from None

    def write(fh) -> None:
        if compress:
            _write_gzipped(fh, chain(held, pieces))
        else:
            for piece in chain(held, pieces):
                fh.write(piece.encode("ascii"))  # every string in it is escaped to ASCII

    write_aside(path, write)  # whole or not at all
    stale = plain + ".gz" if path == plain else plain
    if os.path.exists(stale):
        os.remove(stale)
    return path


def write_trace_beside(path: str | os.PathLike, pieces: Iterable[str], compress: bool | None = False) -> Future:
    """:func:`write_trace`, its text made here, then compressed and written on a thread of its
    own (zlib releases the interpreter); a future whose result is the path, or the error."""
    # one piece: the thread compresses it in one call that holds the interpreter not at
    # all (piece by piece it waited for the interpreter at every piece, the walk holding it)
    text = ["".join(pieces)]
    future: Future = Future()

    def write() -> None:
        try:
            future.set_result(write_trace(path, text, compress))
        except BaseException as err:  # noqa: BLE001 - handed to whoever waits for the file
            future.set_exception(err)

    threading.Thread(target=write, name="pipeflow-trace", daemon=True).start()
    return future


def _write_gzipped(fh, pieces: Iterable[str]) -> None:
    """Write ``pieces`` to the binary file ``fh`` as one gzip stream, piece by piece."""
    # on this thread: a second one compressing beside gained nothing on a shared 2-core host
    deflate = zlib.compressobj(GZIP_LEVEL, zlib.DEFLATED, 31)  # 31: with gzip's header and trailer
    for piece in pieces:
        fh.write(deflate.compress(piece.encode("ascii")))
    fh.write(deflate.flush())


def _viewer_times(starts: np.ndarray, ends: np.ndarray, scale: float, finite: bool) -> tuple[list, list]:
    """``ts`` and ``dur`` in µs on one nanosecond grid (start and end each cut, ``dur`` their
    difference, so touching events never overlap in the viewers); "%.3f" numbers, or JSON
    text (NaN, Infinity) when some time is not finite."""
    if not finite:
        return ([_microseconds(s * scale) for s in starts.tolist()],
                [_microseconds((t - s) * scale) for s, t in zip(starts.tolist(), ends.tolist())])
    begin, finish = starts * (scale * 1000), ends * (scale * 1000)
    if len(begin) and max(np.abs(begin).max(), np.abs(finish).max()) >= 2.0**52:
        # beyond float64's exact integers: Python's ints, whose division rounds once
        begin, finish = list(map(int, begin.tolist())), list(map(int, finish.tolist()))
        thousand = repeat(1000)
        return list(map(truediv, begin, thousand)), list(map(truediv, map(sub, finish, begin), thousand))
    # (below 2**52 nanoseconds, int64 and float64 hold these numbers exactly, and their
    # quotients are Python's)
    begin, finish = begin.astype(np.int64), finish.astype(np.int64)
    return (begin / 1000).tolist(), ((finish - begin) / 1000).tolist()


def _column(values: Iterable, write) -> list[str]:
    """``write(value)`` for every value, each distinct one written once and looked up."""
    return list(map(_Texts(write).__getitem__, values))


class _Texts(dict):
    """value -> ``write(value)``, written on its first look-up (each value hashed once)."""

    def __init__(self, write):
        super().__init__()
        self.write = write

    def __missing__(self, value):
        text = self[value] = self.write(value)
        return text


def _head(key: tuple) -> str:
    """An X record from after its name to its ``ts``: category, phase, process, thread."""
    stream, kind, device, tid = key
    return ',"cat":%s,"ph":"X","pid":%d,"tid":%d,"ts":' % (_quote(kind if stream == "compute" else stream), device, tid)


def _tail(key: tuple) -> str:
    """The args of an X record after its stage and microbatch: the fields not at their
    defaults (the exact times are in exactTimes)."""
    stream, kind, pipe, segment, src, dst, nbytes, version = key
    out = "" if stream == "compute" else ',"kind":' + _quote(kind)
    if stream not in STREAMS:
        out += ',"stream":' + _quote(stream)
    for name, value, default in (("pipe", pipe, 0), ("segment", segment, 0), ("src", src, -1), ("dst", dst, -1)):
        if value != default:
            out += ',"%s":%d' % (name, value)
    if nbytes != 0:
        out += ',"nbytes":' + _number(float(nbytes))
    if version != -1:
        out += ',"version":%d' % version
    return out


def _extra_args(stream: str, extra: dict) -> str:
    """An event's extra in its args; a wait event's keys also at the top, where the
    viewers show them (never over a field of the event)."""
    top = "".join(f",{_quote(str(k))}:{_json(v)}" for k, v in extra.items() if k not in ARG_NAMES) \
        if stream == "wait" else ""
    return top + ',"extra":' + _json(extra)


def _plain(text: str) -> bool:
    """Whether json writes ``text`` as it is: ASCII from space to ~, no quote, no backslash
    (string methods in C, faster than a regular expression over a quarter of a million names)."""
    return text.isascii() and text.isprintable() and '"' not in text and "\\" not in text


def _json(value) -> str:
    return json.dumps(value, separators=(",", ":"))


def _number(x: float) -> str:
    """A float as JSON, the way json.dumps writes it (NaN and Infinity included)."""
    return float.__repr__(x) if math.isfinite(x) else json.dumps(x)


def _microseconds(x: float) -> str:
    return "%.3f" % x if math.isfinite(x) else json.dumps(x)


def _pack(col: np.ndarray) -> str:
    """float64 values as base64 of their little-endian bytes, shuffled (byte 0 of every
    value, then byte 1, ...): sign, exponent and high mantissa bytes repeat."""
    raw = np.frombuffer(col.astype("<f8").tobytes(), dtype=np.uint8)
    return base64.b64encode(raw.reshape(-1, 8).T.tobytes()).decode("ascii")


def _unpack(text: str) -> array:
    planes = base64.b64decode(text)
    n = len(planes) // 8
    raw = bytearray(len(planes))
    for i in range(8):
        raw[i::8] = planes[i * n:(i + 1) * n]
    col = array("d")
    col.frombytes(bytes(raw))
    if sys.byteorder != "little":
        col.byteswap()
    return col


# --------------------------------------------------------------------------- reading
def exact_times(trace: dict) -> tuple[array, array] | None:
    """The exact (starts, ends) of a trace's events in the order of its X records, or None (an
    earlier version's or another tool's trace)."""
    times = trace.get("exactTimes")
    if not isinstance(times, dict) or times.get("encoding") != _TIMES:
        return None
    return _unpack(times["start"]), _unpack(times["end"])


def read_trace(path: str | os.PathLike) -> dict:
    """The parsed JSON of a trace file, plain or gzipped, found as
    :meth:`~pipeflow.formats.timeline.Timeline.load` does; ValueError naming the file when
    it is not JSON."""
    path = timeline_file(path) if os.path.isdir(path) else _existing_form(os.fspath(path))
    with open(path, "rb") as fh:
        data = fh.read()
    try:
        if data[:2] == _GZIP_MAGIC:
            data = gzip.decompress(data)
        return json.loads(data)
    except (OSError, EOFError, ValueError) as exc:  # a bad gzip stream, bad JSON, bad UTF-8
        raise ValueError(f"{os.fspath(path)} is not a JSON timeline ({exc})") from exc


def _existing_form(path: str) -> str:
    """``path``, or its gzipped (or plain) twin when only that one exists."""
    if os.path.exists(path):
        return path
    twin = path[:-3] if path.endswith(".gz") else path + ".gz"
    return twin if os.path.exists(twin) else path


def timeline_file(run_dir: str | os.PathLike, name: str = "timeline.json") -> Path:
    """The timeline a run folder holds: ``name``, or ``name`` + ".gz" when it was saved
    gzipped. FileNotFoundError names both when neither exists."""
    plain = Path(run_dir) / name
    for path in (plain, plain.with_name(plain.name + ".gz")):
        if path.exists():
            return path
    raise FileNotFoundError(f"{run_dir} holds no timeline: neither {name} nor {name}.gz")
