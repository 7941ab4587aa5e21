"""Which weight version every forward and backward sees, from the schedule alone.

A replica's version is the number of STEPs earlier in its device's list. A forward sees
the current one (``double_buffer``: u - 1 in window u); a backward sees the forward's
(``sync``, ``stash``, ``double_buffer``) or the current (``none``, ``bounded``). Per
record: ``mismatch = backward - forward`` and ``staleness = applied - forward``
(``applied``: the version the gradient's update is applied to). The runtime records what
it used; a test checks the two agree."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .ir import Kind, Schedule, WeightPolicy


@dataclass(frozen=True)
class VersionRecord:
    pipe: int
    stage: int
    microbatch: int  # the schedule's microbatch id (offset by the caller for a run)
    update: int  # the update this gradient feeds (global: base_update + local index)
    forward: int  # the version the forward computed with
    backward: int  # the version the backward computed with
    applied: int  # the version the update is applied to

    @property
    def mismatch(self) -> int:
        return self.backward - self.forward

    @property
    def staleness(self) -> int:
        return self.applied - self.forward

    def as_dict(self) -> dict:
        out = asdict(self)
        out["mismatch"] = self.mismatch
        out["staleness"] = self.staleness
        return out


def forward_version(policy: WeightPolicy, live: int, update: int) -> int:
    """The version a forward uses under ``policy`` when ``live`` updates have been applied."""
    if policy == WeightPolicy.DOUBLE_BUFFER:
        return max(update - 1, 0)
    return live


def weight_versions(schedule: Schedule, base_update: int = 0) -> list[VersionRecord]:
    """Records for every (pipe, stage, microbatch) in device-list order; ``base_update``: the
    updates applied before this schedule runs (the runtime's consecutive chunks)."""
    policy = schedule.policy
    upd = schedule.update_of_microbatch
    out: list[VersionRecord] = []
    for order in schedule.orders:
        live: dict[tuple[int, int], int] = {}
        fwd: dict[tuple[int, int, int], int] = {}
        bwd: dict[tuple[int, int, int], int] = {}
        applied: dict[tuple[int, int, int], int] = {}
        for a in order:
            key = (a.pipe, a.stage)
            cur = live.get(key, base_update)
            if a.kind == Kind.F:
                u = base_update + upd[a.microbatch]
                v = forward_version(policy, cur, u)
                if v > cur or (policy == WeightPolicy.DOUBLE_BUFFER and v < cur - 1):
                    raise ValueError(
                        f"schedule {schedule.name!r}: {a} needs weight version {v} but version {cur} is current; "
                        f"double buffering keeps only the current and the previous version"
                    )
                fwd[(a.pipe, a.stage, a.microbatch)] = v
            elif a.kind in Kind.BACKWARD:
                f = fwd[(a.pipe, a.stage, a.microbatch)]
                keep = policy in (WeightPolicy.STASH, WeightPolicy.DOUBLE_BUFFER)
                bwd[(a.pipe, a.stage, a.microbatch)] = f if keep else cur
            elif a.kind == Kind.STEP:
                applied[(a.pipe, a.stage, base_update + a.version)] = cur
                live[key] = cur + 1
        for (pipe, stage, mb), f in fwd.items():
            u = base_update + upd[mb]
            out.append(VersionRecord(pipe, stage, mb, u, f, bwd[(pipe, stage, mb)], applied.get((pipe, stage, u), f)))
    return out


def summarize(records) -> dict:
    """max/mean staleness and mismatch; accepts VersionRecords or their dicts."""
    rows = [r.as_dict() if isinstance(r, VersionRecord) else r for r in records]
    if not rows:
        return {"max_staleness": 0, "mean_staleness": 0.0, "max_mismatch": 0, "mean_mismatch": 0.0,
                "mismatched": 0}
    st = [r["staleness"] for r in rows]
    mm = [r["mismatch"] for r in rows]
    return {
        "max_staleness": max(st),
        "mean_staleness": sum(st) / len(st),
        "max_mismatch": max(mm),
        "mean_mismatch": sum(mm) / len(mm),
        "mismatched": sum(1 for x in mm if x),
    }


def tied_update_plan(schedule: Schedule, tied_stages, completion: list | None = None
                     ) -> dict[int, dict[tuple[int, int, int], list[int]]]:
    """Where an asynchronous schedule applies each update of a weight several stages share (a
    tied embedding and head): device -> (pipe, stage, w) -> the updates that replica applies at
    its STEP w (``w = -1``: after its chunk's last STEP), each at the first STEP after the last
    backward feeding it on any of those stages (:func:`~pipeflow.schedules.validate.dry_run`
    order; ``completion``: that order, where the caller ran it). Empty when fewer than two
    stages share a weight."""
    from .validate import dry_run

    tied = set(tied_stages)
    if len(tied) < 2:
        return {}
    upd = schedule.update_of_microbatch
    done_at = {a: i for i, a in enumerate(dry_run(schedule) if completion is None else completion)}
    last: dict[int, int] = {}  # update -> when its last backward into a tied stage is done
    for order in schedule.orders:
        for a in order:
            if a.kind in Kind.WEIGHT_GRAD and a.stage in tied:
                u = upd[a.microbatch]
                last[u] = max(last.get(u, -1), done_at[a])
    out: dict[int, dict[tuple[int, int, int], list[int]]] = {}
    for dev, order in enumerate(schedule.orders):
        reps = sorted({(a.pipe, a.stage) for a in order if a.stage in tied})
        for pipe, stage in reps:
            steps = sorted((done_at[a], a.version) for a in order
                           if a.kind == Kind.STEP and (a.pipe, a.stage) == (pipe, stage))
            for u, t in sorted(last.items()):
                w = next((v for when, v in steps if when > t), None)
                out.setdefault(dev, {}).setdefault((pipe, stage, -1 if w is None else w), []).append(u)
    return out
