"""Costs measured on this machine: :class:`ProfiledCost` (per-layer times from a
``profile.json``) and :class:`CalibratedCost` (what a real step of a configuration costs,
from a ``calibration.json``; :mod:`pipeflow.runtime.calibration_run`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from ..topology.topology import Device
from .cost import COARSE_ABSENT, KINDS, CostModel, _check_int
from .layer_profile import MODEL_STATE_FACTOR, load_profile, partition_profile
from .transformer import TransformerSpec

class ProfiledCost(CostModel):
    """Per-stage costs summed from a profile measured on this machine
    (:mod:`pipeflow.models.profiler`): stage s holds ``layers_per_stage[s]`` blocks (None: the
    profiled partitioner's split), the first also the embedding, the last the head. F and B
    are the units' measured seconds, I and W half of B each, S the optimizer step; activations
    are what autograd saved, the I-to-W residual 0. One sequence segment only."""

    absent_terms = COARSE_ABSENT  # activations, messages and model state alone

    name = "profiled"

    def __init__(
        self,
        num_stages: int,
        spec: TransformerSpec | None = None,
        microbatch_size: int | None = None,
        profile: str | None = None,
        layers_per_stage: Sequence[int] | None = None,
    ) -> None:
        self.num_stages = _check_int("pipeline.stages", num_stages)
        self.profile_path = profile
        self.profile = load_profile(profile, key="cost.profile")
        prof = self.profile
        if spec is not None and (spec.n_layer, spec.n_embd, spec.seq_len) != (prof.n_layer, prof.n_embd, prof.seq_len):
            raise ValueError(
                f"cost.profile={profile}: it profiles n_layer={prof.n_layer}, n_embd={prof.n_embd}, "
                f"seq_len={prof.seq_len}, but model '{spec.name}' has {spec.n_layer}, {spec.n_embd}, {spec.seq_len}; "
                f"profile this model"
            )
        if microbatch_size is not None and microbatch_size != prof.microbatch_size:
            raise ValueError(
                f"cost.profile={profile}: it was measured with microbatches of {prof.microbatch_size} sequences, "
                f"but pipeline.microbatch_size={microbatch_size}; profile with that microbatch size"
            )
        if layers_per_stage is None:
            layers = partition_profile(prof, self.num_stages)
        else:
            layers = list(layers_per_stage)
            if (
                len(layers) != self.num_stages
                or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in layers)
                or sum(layers) != prof.n_layer
            ):
                raise ValueError(
                    f"cost.layers_per_stage={layers}: needs {self.num_stages} whole numbers >= 1 "
                    f"(pipeline.stages={self.num_stages}) adding up to the profile's n_layer={prof.n_layer}"
                )
        self.layers_per_stage = tuple(layers)
        units = prof.stage_units(layers)
        fwd = [sum(u.forward_s for u in us) for us in units]
        bwd = [sum(u.backward_s for u in us) for us in units]
        self._time = {
            "F": fwd,
            "B": bwd,
            "I": [b / 2 for b in bwd],
            "W": [b / 2 for b in bwd],
            "S": [sum(u.step_s for u in us) for us in units],
        }
        self._activation = [float(sum(u.activation_bytes for u in us)) for us in units]
        self._params = [float(sum(u.param_bytes for u in us)) for us in units]

    def _check_segment(self, segment: int) -> None:
        if segment != 0:
            raise ValueError(
                f"segment {segment}: cost model 'profiled' measures whole sequences (one segment); "
                f"use pipeline.segments=1"
            )

    def compute_time(self, kind: str, stage: int, segment: int, device: Device) -> float:
        if kind not in self._time:
            raise self._bad_kind(kind)
        self._check_segment(segment)
        return self._time[kind][stage]

    def message_bytes(self, src_stage: int, dst_stage: int, segment: int) -> float:
        return float(self.profile.message_bytes())

    def activation_bytes(self, stage: int, segment: int) -> float:
        return self._activation[stage]

    def weight_residual_bytes(self, stage: int, segment: int) -> float:
        return 0.0

    def param_bytes(self, stage: int) -> float:
        return self._params[stage]

    def model_state_bytes(self, stage: int) -> float:
        return MODEL_STATE_FACTOR * self._params[stage]

    def describe(self) -> dict:
        prof = self.profile
        return {
            "name": self.name,
            "profile": self.profile_path,
            "model": prof.model,
            "device": prof.device,
            "num_stages": self.num_stages,
            "layers_per_stage": list(self.layers_per_stage),
            "microbatch_size": prof.microbatch_size,
            "stage_forward_s": self._time["F"],
            "stage_backward_s": self._time["B"],
            "stage_step_s": self._time["S"],
            "stage_activation_bytes": self._activation,
            "stage_param_bytes": self._params,
        }


# ------------------------------------------------------------------ config

# --------------------------------------------------------------------------- calibrated
# Costs calibrated on this machine: the simulator's model of a real step of one configuration.
# 
# :mod:`pipeflow.runtime.calibration_run` runs a configuration's ranks and measures, with the
# runtime's own code, what each action of each (stage, segment) costs alone, what a gloo
# message costs (``latency + bytes / bandwidth``), how the ranks slow each other down when
# they compute at once on the host's cores, and the synchronisation before the optimizer
# step. :class:`CalibratedCost` reads that file (``cost=calibrated
# cost.calibration=<file>``):
# 
# - F, B, I, W: the measured times, from a replay of the schedule's own actions in its
#   order. The loss is inside the last stage's F, the executor's hooks inside every
#   action, as in a real step.
# - S: the stage's measured optimizer step. The synchronisation (the tied embedding's
#   all-reduce and the world all-reduce of the gradient norm) is ``step_sync``: a
#   synchronous step runs it once per rank, before the rank's first STEP, and the
#   simulator charges it there (not per stage: a rank holding two stages syncs once;
#   not at all in asynchronous schedules, whose STEPs do not synchronise the world).
# - messages: the measured bytes of each stage-to-stage tensor; their time comes from
#   the topology, whose ``local_cpu`` latency and bandwidth the calibration sets
#   (:func:`calibrated_topology_params`), together with the host's ``cores`` and ``contention``
#   that drive the simulator's processor sharing and ``message_host``, the host time
#   each message takes from its sender's and its receiver's compute, and the rate a
#   gloo all-reduce reaches (``collective_bandwidth``: the replicas' REDUCE, measured at 1
#   and 8 MiB; calibrations made before it was measured price REDUCE at the link's rate).
# - memory: the bytes autograd saved in each forward, measured.
# - tensor parallelism (pipeline.tensor_parallel=T): the times are one rank's of each
#   device's group of T, their collectives inside as measured, so nothing is added; the
#   topology is the run's TensorTopology. The file records T and sequence_parallel, and
#   a simulation of another T or sequence parallelism is refused.
# 
# torch-free: a calibration is plain JSON.

FORMAT, VERSION = "pipeflow-calibration", 1
HOST_KEYS = ("cores", "contention", "latency", "bandwidth", "message_host", "collective_bandwidth")


def load_calibration(path: str | Path | None, key: str = "cost.calibration") -> dict:
    """A calibration file's contents, or a ValueError naming ``key``."""
    if path is None:
        raise ValueError(f"{key}=null: a calibration file is needed "
                         f"(python -m pipeflow.calibrate --out calibration.json <train overrides>)")
    p = Path(str(path)).expanduser()
    if not p.is_file():
        raise ValueError(f"{key}={path}: no such file; give the path of a calibration.json")
    try:
        data = json.loads(p.read_text())
    except UnicodeDecodeError as err:
        raise ValueError(f"{key}={path}: not a calibration file (not UTF-8 text: byte {err.start} is "
                         f"0x{err.object[err.start]:02x}); give a calibration.json") from None
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{key}={path}: not a calibration file ({err})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("version") != VERSION:
        raise ValueError(f"{key}={path}: not a {FORMAT} version {VERSION} file")
    return data


class CalibratedCost(CostModel):
    """Per-(kind, stage, segment) times measured by :mod:`pipeflow.runtime.calibration_run`."""

    absent_terms = COARSE_ABSENT  # activations, messages and model state alone

    name = "calibrated"

    def __init__(self, num_stages: int, calibration: str | None = None, tensor_parallel: int = 1,
                 sequence_parallel: bool = False) -> None:
        self.num_stages = _check_int("pipeline.stages", num_stages)
        self.path = calibration
        self.data = load_calibration(calibration)
        have = int(self.data["config"]["num_stages"])
        if have != self.num_stages:
            raise ValueError(
                f"cost.calibration={calibration}: it measured {have} stages, the schedule has {self.num_stages}; "
                f"calibrate this stage layout (pipeline.stages, pipeline.virtual_stages, the partition)"
            )
        # tensor parallelism: the times are one rank's of each device's tensor group,
        # collectives included as measured; only a calibration of the same groups holds them
        self.tensor_parallel = int(tensor_parallel)
        self.sequence_parallel = bool(sequence_parallel) and self.tensor_parallel > 1
        made = self.data["config"]
        for key, want, got in (
            ("pipeline.tensor_parallel", self.tensor_parallel, int(made.get("tensor_parallel", 1))),
            ("pipeline.sequence_parallel", self.sequence_parallel,
             bool(made.get("sequence_parallel", False)) and int(made.get("tensor_parallel", 1)) > 1),
        ):
            if want != got:
                raise ValueError(
                    f"{key}={str(want).lower()}: cost.calibration={calibration} was measured with "
                    f"{key}={str(got).lower()} (its times hold that tensor split and its collectives); "
                    f"calibrate with {key}={str(want).lower()}"
                )
        self.times: dict[tuple[str, int, int], float] = {}
        for key, v in self.data["times"].items():
            kind, stage, seg = key.split("|")
            self.times[(kind, int(stage), int(seg))] = float(v)
        self.sync = float(self.data.get("sync_s", 0.0))
        # the simulator adds it to each rank's first STEP of a synchronous step
        self.step_sync = self.sync
        self.act = {tuple(int(x) for x in k.split("|")): float(v) for k, v in self.data["activation_bytes"].items()}
        self.msg = {tuple(int(x) for x in k.split("|")): float(v) for k, v in self.data["message_bytes"].items()}
        self.params = {int(k): float(v) for k, v in self.data["param_bytes"].items()}
        self.host = {k: self.data["host"][k] for k in HOST_KEYS if k in self.data["host"]}

    def place_tensor_groups(self, topology) -> None:
        """Nothing to price: the measured times hold the tensor groups' collectives. Checks
        that ``topology`` groups its devices as the calibration did."""
        got = getattr(topology, "tensor_parallel", 1)
        if got != self.tensor_parallel:
            raise ValueError(f"pipeline.tensor_parallel={self.tensor_parallel}: topology '{topology.name}' is "
                             f"grouped in tensor groups of {got}, cost.calibration={self.path} of "
                             f"{self.tensor_parallel}")

    def compute_time(self, kind: str, stage: int, segment: int, device: Device) -> float:
        if kind not in KINDS:
            raise self._bad_kind(kind)
        if kind == "S":
            return self.times.get(("S", stage, 0), 0.0)
        got = self.times.get((kind, stage, segment))
        if got is None and kind in ("I", "W") and ("B", stage, segment) in self.times:
            # a segmented calibration runs full backwards only: no measured split
            raise ValueError(f"cost model 'calibrated' has no {kind} time for stage {stage}: "
                             f"the calibrated configuration cannot split its backward")
        if got is None:
            raise ValueError(f"cost model 'calibrated' has no {kind} time for stage {stage}, segment {segment}; "
                             f"calibrate this configuration")
        return got

    def message_bytes(self, src_stage: int, dst_stage: int, segment: int) -> float:
        return self.msg.get((src_stage, dst_stage, segment), max(self.msg.values(), default=0.0))

    def activation_bytes(self, stage: int, segment: int) -> float:
        return self.act.get((stage, segment), 0.0)

    def weight_residual_bytes(self, stage: int, segment: int) -> float:
        return 0.0

    def param_bytes(self, stage: int) -> float:
        return self.params.get(stage, 0.0)

    def describe(self) -> dict:
        return {
            "name": self.name,
            "calibration": self.path,
            "num_stages": self.num_stages,
            "config": self.data.get("config"),
            "times": {f"{s}{k}" + (f"s{g}" if g else ""): v for (k, s, g), v in sorted(self.times.items(),
                                                                                      key=lambda kv: kv[0][1:])},
            "sync_s": self.sync,
            "host": self.host,
        }


def calibrated_topology_params(cost: CostModel) -> dict:
    """The ``local_cpu`` parameters a calibrated cost model brings (empty for other models)."""
    if not isinstance(cost, CalibratedCost):
        return {}
    return dict(cost.host)
