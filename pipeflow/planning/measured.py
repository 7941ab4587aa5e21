"""A cost model measured from a run: mean per-(kind, stage) action times read off one
iteration's timeline, so the simulator replays a schedule at the costs the hardware had
(``benchmarks/bench_predicted_vs_measured.py``). An event is counted from its cross-device
input's arrival (``producer end + message time``); the message time is fixed or
calibrated from the producer-to-consumer gaps (:meth:`_Gaps.calibrated_message_time`);
``step_sync``, the smallest gap before a device's first STEP, is added once to each
device's first STEP. The host's time between two ready actions is not modelled."""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from typing import Mapping

from ..topology.topology import Device
from .cost import COARSE_ABSENT, KINDS, CostModel, _check_int, _check_number


class MeasuredCost(CostModel):
    """Fixed per-(kind, stage) compute times (kinds F, B, I, W, S) in ``time_unit``;
    ``message_time`` every message's (None: the topology prices ``message_bytes``, which needs
    ``time_unit="s"``). Memory sizes are the given constants (0 by default): not measured."""

    absent_terms = COARSE_ABSENT  # activations, messages and model state alone

    name = "measured"

    def __init__(
        self,
        num_stages: int,
        times: Mapping[tuple[str, int], float],
        message_time: float | None = None,
        message_bytes: float = 0.0,
        activation_bytes: float = 0.0,
        param_bytes: float = 0.0,
        time_unit: str = "s",
        step_overhead: float = 0.0,
        samples: Mapping[tuple[str, int], int] | None = None,
        message_samples: int = 0,
    ) -> None:
        self.num_stages = _check_int("pipeline.stages", num_stages)
        clean: dict[tuple[str, int], float] = {}
        for key, value in times.items():
            kind, stage = key
            if kind not in KINDS:
                raise ValueError(f"measured time for kind {kind!r}: kinds are {', '.join(KINDS)}")
            if not (isinstance(stage, int) and 0 <= stage < self.num_stages):
                raise ValueError(
                    f"measured time for stage {stage!r}: stages are 0 to {self.num_stages - 1} "
                    f"(pipeline.stages={self.num_stages})"
                )
            clean[(kind, stage)] = _check_number(f"measured time of {kind} on stage {stage}", value)
        self.times = clean
        self.message_time = None if message_time is None else _check_number("message_time", message_time)
        if self.message_time is None and time_unit != "s":
            raise ValueError(
                f"time_unit={time_unit!r} with message_time=None: the topology prices messages in seconds; "
                f"give a message_time in {time_unit}, or measure in seconds"
            )
        self.message = _check_number("message_bytes", message_bytes)
        self.activation = _check_number("activation_bytes", activation_bytes)
        self.params = _check_number("param_bytes", param_bytes)
        self.time_unit = time_unit
        # diagnostics of from_timeline, reported by describe()
        self.step_overhead = step_overhead
        self.step_sync = step_overhead  # the simulator charges it before each device's first STEP
        self.samples = dict(samples or {})
        self.message_samples = message_samples

    # ---------------------------------------------------------------- CostModel
    def compute_time(self, kind: str, stage: int, segment: int, device: Device) -> float:
        try:
            return self.times[(kind, stage)]
        except KeyError:
            if kind not in KINDS:
                raise self._bad_kind(kind) from None
            have = sorted(k for k, s in self.times if s == stage)
            raise ValueError(
                f"cost model 'measured' has no time for {kind} on stage {stage}: the measurement holds "
                f"{', '.join(have) or 'nothing'} for that stage; measure a run of a schedule with {kind} actions"
            ) from None

    def message_bytes(self, src_stage: int, dst_stage: int, segment: int) -> float:
        return self.message

    def activation_bytes(self, stage: int, segment: int) -> float:
        return self.activation

    def weight_residual_bytes(self, stage: int, segment: int) -> float:
        return 0.0

    def param_bytes(self, stage: int) -> float:
        return self.params

    def describe(self) -> dict:
        def by_stage(table: Mapping[tuple[str, int], float]) -> dict:
            # "0F", "0B", ..., "1F": the action notation's stage-then-kind order
            return {f"{stage}{kind}": v for (kind, stage), v in sorted(table.items(), key=lambda kv: kv[0][::-1])}

        return {
            "name": self.name,
            "num_stages": self.num_stages,
            "time_unit": self.time_unit,
            "times": by_stage(self.times),
            "samples": by_stage(self.samples),
            "message_time": self.message_time,
            "message_samples": self.message_samples,
            "message_bytes": self.message,
            "step_overhead": self.step_overhead,
        }

    # ---------------------------------------------------------------- measuring
    @classmethod
    def from_timeline(
        cls,
        timeline,
        num_stages: int,
        message_time: float | str | None = "calibrate",
        message_bytes: float = 0.0,
        activation_bytes: float = 0.0,
        param_bytes: float = 0.0,
    ) -> "MeasuredCost":
        """Mean durations per (kind, stage) of one iteration's timeline, the stages a chain, every
        replica's events counted. ``message_time``: "calibrate" (None without a sample), a number
        in the timeline's unit, or None (links price ``message_bytes``). With replicated stages
        (Chimera) S also holds the replicas' all-reduce, which the simulator prices again."""
        num_stages = _check_int("pipeline.stages", num_stages)
        events = _compute_events(timeline, num_stages)
        work = [e for e in events if e.kind != "S"]
        gaps = _Gaps(timeline, work, num_stages)
        samples: list[float] = []
        if message_time == "calibrate":
            msg, samples = gaps.calibrated_message_time()
        elif message_time is None or (isinstance(message_time, (int, float)) and not isinstance(message_time, bool)):
            msg = message_time
        else:
            raise ValueError(f"message_time={message_time!r}: use 'calibrate', a number, or None")
        times, counts = gaps.compute_times(msg or 0.0)
        overhead = _step_times([e for e in events if e.kind == "S"], gaps.prev_end, times, counts)
        missing = [s for s in range(num_stages) if ("F", s) not in times]
        if missing:
            raise ValueError(
                f"the timeline has no forward of stage(s) {missing} (num_stages={num_stages}); "
                f"record a whole iteration of every rank"
            )
        return cls(
            num_stages,
            times,
            message_time=msg,
            message_bytes=message_bytes,
            activation_bytes=activation_bytes,
            param_bytes=param_bytes,
            time_unit=timeline.time_unit,
            step_overhead=overhead,
            samples=counts,
            message_samples=len(samples),
        )


def _compute_events(timeline, num_stages: int) -> list:
    """The timeline's compute events (F, B, I, W, S); ValueError if it has none or one is not
    on a stage below ``num_stages``."""
    events = [e for e in timeline.events if e.stream == "compute" and e.kind in KINDS]
    if not events:
        raise ValueError("the timeline has no compute events (F, B, I, W, S); record an iteration first")
    for e in events:
        if not 0 <= e.stage < num_stages:
            raise ValueError(
                f"timeline event {e.name} is on stage {e.stage}, but num_stages={num_stages}; "
                f"pass the number of stages the run had"
            )
    return events


class _Gaps:
    """What an action could have waited for: its producer on another device (the action
    whose tensor it needs) and the moment its own device was last busy before it."""

    def __init__(self, timeline, work: list, num_stages: int) -> None:
        self.work = work  # the compute events but the optimizer steps
        by_key = {(e.pipe, e.kind, e.stage, e.microbatch, e.segment): e for e in work}
        self.producer = {id(e): _producer(e, by_key, num_stages - 1) for e in work}
        # when each device last finished something before each event (a REDUCE counts;
        # a simulated transfer, drawn on its sender's "comm" stream, does not occupy it)
        self.prev_end: dict[int, float] = {}
        per_device: dict[int, list] = defaultdict(list)
        for e in timeline.events:
            if e.stream in ("compute", "collective"):
                per_device[e.device].append(e)
        for evs in per_device.values():
            evs.sort(key=lambda x: (x.start, x.end))
            latest = -math.inf
            for x in evs:
                self.prev_end[id(x)] = latest
                latest = max(latest, x.end)

    def message_samples(self, delay: float) -> list[float]:
        """Message-time samples, taking the events whose input had arrived when they
        started (producer end + ``delay`` <= start) as the clean compute times."""
        clean: dict[tuple[str, int], list[float]] = defaultdict(list)
        for e in self.work:
            p = self.producer[id(e)]
            if p is None or p.end + delay <= e.start:
                clean[(e.kind, e.stage)].append(e.duration)
        clean_mean = {k: statistics.fmean(v) for k, v in clean.items()}
        found = []
        for e in self.work:
            p = self.producer[id(e)]
            if p is None:
                continue
            if self.prev_end[id(e)] <= p.end <= e.start:
                # idle from before the producer ended until it started: waiting for the message
                found.append(e.start - p.end)
            elif p.end > e.start and (e.kind, e.stage) in clean_mean:
                # started before the producer ended: the wait is inside the event
                found.append(e.end - clean_mean[(e.kind, e.stage)] - p.end)
        return found

    def calibrated_message_time(self) -> tuple[float | None, list[float]]:
        """The median message-time sample (None without one), and the samples; reclassifies the
        events with the time found until it settles (an in-flight message hides a little wait)."""
        msg, delay, samples = None, 0.0, []
        for _ in range(4):
            samples = self.message_samples(delay)
            if not samples:
                break
            msg = max(0.0, statistics.median(samples))
            if msg == delay:
                break
            delay = msg
        return msg, samples

    def compute_times(self, arrival_delay: float) -> tuple[dict, dict]:
        """The mean time per (kind, stage) of every event from the moment it could compute
        (its input's arrival, ``arrival_delay`` after its producer's end), and the counts."""
        parts: dict[tuple[str, int], list[float]] = defaultdict(list)
        for e in self.work:
            p = self.producer[id(e)]
            begin = e.start if p is None else max(e.start, p.end + arrival_delay)
            # clamp: with noisy measurements an estimated arrival may fall after the end
            parts[(e.kind, e.stage)].append(max(0.0, e.end - begin))
        return {k: statistics.fmean(v) for k, v in parts.items()}, {k: len(v) for k, v in parts.items()}


def _producer(e, by_key: dict, last: int):
    """The event on another device whose tensor ``e`` needs (the stage chain's neighbour's
    forward or backward of the same microbatch), or None."""
    if e.kind == "F" and e.stage > 0:
        keys = [(e.pipe, "F", e.stage - 1, e.microbatch, e.segment)]
    elif e.kind in ("B", "I") and e.stage < last:
        keys = [(e.pipe, k, e.stage + 1, e.microbatch, e.segment) for k in ("B", "I")]
    else:
        return None
    for k in keys:
        p = by_key.get(k)
        if p is not None:
            return p if p.device != e.device else None
    return None


def _step_times(steps: list, prev_end: dict, times: dict, counts: dict) -> float:
    """Adds the optimizer step's mean time per stage to ``times`` (and ``counts``); returns
    ``step_sync`` (see the module docstring)."""
    if not steps:
        return 0.0
    first_step: dict[int, object] = {}
    for e in steps:
        if e.device not in first_step or e.start < first_step[e.device].start:
            first_step[e.device] = e
    gaps = [max(0.0, e.start - prev_end[id(e)]) for e in first_step.values() if prev_end[id(e)] > -math.inf]
    s_parts: dict[int, list[float]] = defaultdict(list)
    for e in steps:
        s_parts[e.stage].append(e.duration)
    for stage, v in s_parts.items():
        times[("S", stage)] = statistics.fmean(v)
        counts[("S", stage)] = len(v)
    return min(gaps) if gaps else 0.0
