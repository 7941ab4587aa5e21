"""The analytic cost's times on a device with a profile: each action's operators priced as measured there
(:mod:`pipeflow.planning.device_profile`) instead of FLOPs at a fraction of the peak."""

from __future__ import annotations

from .from_sweep import load_profile
from .layer_operators import block_tensors
from .operators import CLASSES, Operator, Shape
from .stage_operators import StageOperators, step_operators
from .transformer import TransformerSpec


class OperatorTimes:
    """Operator-priced action times, a mixin of :class:`~pipeflow.planning.cost.AnalyticCost` (reads its
    shape, stages, segments, dtype and ``_params``)."""

    spec: TransformerSpec

    def operators(self, kind: str, stage: int, segment: int = 0) -> list[Operator]:
        """The operators action ``kind`` (F, B, I, W or S) launches on ``stage``, in order."""
        if kind == "S":
            return self._step_operators(stage)
        x = self._seg(segment)
        sh = Shape(self.spec, self.microbatch_size, self.segment_lengths[x], self.prefixes[x], self.dtype_bytes)
        return StageOperators(sh, self.layers_per_stage[stage], stage == 0, stage == self.num_stages - 1).action(kind)

    def _step_operators(self, stage: int) -> list[Operator]:
        spec, n = self.spec, self.layers_per_stage[stage]
        first, last = stage == 0, stage == self.num_stages - 1
        norm = 1 if spec.norm == "rmsnorm" else 2
        # the embedding's tables (BERT's token types and norm too); the head's norm, its own
        # matrix where untied (BERT: the transform, its norm and the decoder's bias)
        embedding = 1 + (spec.position_embedding == "learned") + (1 + norm if spec.post_norm else 0)
        head = norm + (not spec.tied) + (2 + norm + 1 if spec.post_norm else 0)
        tensors = n * block_tensors(spec) + (embedding if first else 0) + (head if last else 0)
        products = n * (spec.mlp_matrices + (2 if spec.qkv_inputs == 1 else 4)) + int(last)
        matrices = self.working_set.cast_params[stage]
        return step_operators(int(self._params[stage]), tensors, int(matrices), products, self.dtype_bytes,
                              getattr(self, "step_impl", "fused"))

    def operator_time(self, kind: str, stage: int, segment: int, profile: str) -> float:
        return self._priced(kind, stage, segment, profile)[0]

    def operator_split(self, kind: str, stage: int, segment: int, profile: str) -> dict[str, float]:
        """Seconds of one action by operator class (:data:`pipeflow.planning.operators.CLASSES`)."""
        return dict(self._priced(kind, stage, segment, profile)[1])

    def _priced(self, kind: str, stage: int, segment: int, profile: str) -> tuple[float, tuple]:
        cache = self.__dict__.setdefault("_operator_times", {})
        key = (kind, stage, self._seg(segment) if kind != "S" else 0, profile)
        if key not in cache:
            prof = load_profile(profile)  # (read once per process)
            ops = self.operators(kind, stage, segment)
            t, split = prof.action(ops, backward=kind in "BIW")
            if kind != "S":  # the host's own time per block, beyond the kernels' calls (a CPU's)
                host = self.layers_per_stage[stage] * prof.block_time(self.spec.family, kind, first=stage == 0)
                t, split = t + host, {**split, "host": split.get("host", 0.0) + host}
            cache[key] = (t, tuple(split.items()))
        return cache[key]


def device_split(cost, orders, profile: str) -> dict[str, float]:
    """Seconds a device's compute actions (``orders``) spend in each operator class on ``profile``."""
    counts: dict = {}
    for a in orders:
        if a.kind in "FBIWS":
            key = (a.kind, a.stage, a.segment if a.kind != "S" else 0)
            counts[key] = counts.get(key, 0) + 1
    out = dict.fromkeys(CLASSES, 0.0)
    for (kind, stage, segment), n in counts.items():
        for cls, t in cost.operator_split(kind, stage, segment, profile).items():
            out[cls] += n * t
    return out
