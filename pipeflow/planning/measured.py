"""A cost model measured from a run: per-stage action times read off a timeline.

:meth:`MeasuredCost.from_timeline` turns the timeline of one iteration (measured by the
runtime, or simulated) into mean durations per (action kind, stage) and a per-message
time, so the simulator can replay the schedule with the costs the hardware actually
had. Comparing that prediction with the measured step time checks the simulator's
model of a pipeline (dependencies, messages, the flush) on real numbers.

What an event contains. A simulated action starts when its input has arrived. A
measured one may not: a runtime that starts the clock before waiting on the receive
of the action's input (pipeflow's executor did until it learned to wait first) records
wait + compute in one event. Both read correctly here: an event whose cross-device
input (F: the forward of the previous stage; B/I: the backward of the next stage, same
microbatch) could not have arrived when it started is counted only from the input's
arrival, ``producer end + message time``.

The message time (when ``message_time="calibrate"``) comes from the gaps between a
producer and its consumer on another device, in either of two forms:

- the consumer's device was free before the producer ended and started the consumer
  after it (it waited outside any event): ``consumer start - producer end``;
- the consumer started before the producer ended (it waited inside its event):
  ``consumer end - mean compute time - producer end``, the mean taken over the events
  of the same kind and stage that did not wait.

The median of those samples is the message time: a fixed time per message in the
timeline's own clock. On a host of CPU ranks a message costs gloo's per-message work
and the wake-up of a waiting rank far more than bytes over a link, and calibrating also
absorbs the tens of microseconds by which the ranks' clocks start apart (each rank
times from its own exit from the step's barrier). With no sample (no rank ever waited
for a message) the message time is unknown and the topology's links price
``message_bytes`` (bandwidth plus latency) instead.

What is not modelled: the time a device spends between two actions whose inputs are
there (posting sends and receives, the executor's own bookkeeping, a rank descheduled
while its peer computes). It is neither compute nor message, so the replay leaves it
out and tends to predict a little short on a busy host.

The optimizer step. Before its first STEP the runtime synchronises the ranks (the tied
embedding's all-reduce and the gradient-norm all-reduce), which the schedule does not
model as an action. That time shows as the gap before STEP; the smallest gap over the
devices (the last device to finish its backward waits only for the collective itself)
is ``step_sync``, which the simulator adds once to each device's first STEP of a
synchronous step. A simulated timeline has no such gap.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from typing import Mapping

from ..topology.topology import Device
from .cost import COARSE_ABSENT, KINDS, CostModel, _check_int, _check_number


class MeasuredCost(CostModel):
    """Fixed per-(kind, stage) compute times, e.g. means measured in a real run.

    ``times`` maps (kind, stage) to a duration in ``time_unit`` for kinds F, B, I, W, S;
    every stage the simulator runs must have its kinds. ``message_time`` is the time of
    every message (None: the topology prices ``message_bytes`` over its links, which
    needs ``time_unit="s"``). Memory is not measured: activation and gradient sizes are
    the given constants (0 by default), so memory figures from a simulation with this
    model are not meaningful unless they are set.
    """

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
        """Mean durations per (kind, stage) of one iteration's timeline (see the module doc).

        ``message_time``: "calibrate" (from the gaps; None if there is no sample), a
        number (fixed, in the timeline's unit), or None (the topology's links price
        ``message_bytes``). The stage graph is taken to be a chain 0 -> 1 -> ... (the
        runtime executes chains); events of every pipeline replica count. With
        replicated stages (Chimera) a measured gap before STEP also holds the replicas'
        all-reduce, which the simulator prices again through REDUCE: expect S too long.
        """
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
    """The timeline's compute events (F, B, I, W, S), each checked to be on one of the
    ``num_stages`` stages."""
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
        """The median message-time sample (None without one), and the samples.

        Start by calling clean every event whose producer had ended when it began; one
        whose message was still in flight then hides a little wait, so classify again
        with the message time found, until it settles (two rounds in practice)."""
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
    the synchronisation before it: the smallest gap before a device's first STEP (see the
    module doc)."""
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
