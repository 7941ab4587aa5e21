"""A measured profile of a GPT's layer sequence, and the partition it implies (torch-free).
:class:`ModelProfile` holds a :class:`LayerProfile` per unit the runtime cuts into stages
(embedding, blocks, head with the loss): seconds per microbatch, saved and parameter bytes.
:func:`partition_profile` is the ``profiled`` partitioner; stage s of p's peak memory is
modelled as ``(p - s) x activation bytes + 4 x parameter bytes``."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

from pipeflow.faults import WriteFailed
from pipeflow.formats.files import write_aside

FORMAT = "pipeflow-profile"
VERSION = 1
UNIT_KINDS = ("embedding", "block", "head")
# weights + gradients + AdamW's two moments, all fp32 in the runtime
MODEL_STATE_FACTOR = 4


def check_stage_count(stages: int, n_layer: int) -> None:
    """Every partitioner's rule: a whole number of stages, each with at least one layer."""
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise ValueError(f"pipeline.stages={stages!r}: must be a whole number >= 1")
    if stages > n_layer:
        raise ValueError(
            f"pipeline.stages={stages}: the model has {n_layer} layers and every stage needs at least one; "
            f"allowed values: 1 to {n_layer}"
        )


@dataclass(frozen=True)
class LayerProfile:
    """One unit of the layer sequence, measured for one microbatch."""

    name: str  # "embedding", "block.3", "head"
    kind: str  # embedding | block | head
    forward_s: float
    backward_s: float
    activation_bytes: int  # saved by autograd in the forward, freed by the backward
    param_bytes: int
    step_s: float = 0.0  # the optimizer step over this unit's parameters

    @property
    def time_s(self) -> float:
        """What the partitioner balances: forward + backward."""
        return self.forward_s + self.backward_s


@dataclass
class ModelProfile:
    """A model's units in order: embedding, blocks 0..n-1, head."""

    model: str
    n_layer: int
    n_embd: int
    vocab_size: int
    seq_len: int
    microbatch_size: int
    units: list[LayerProfile]
    device: str = "cpu"
    threads: int = 1
    dtype_bytes: int = 4  # the runtime trains and sends fp32
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        kinds = [u.kind for u in self.units]
        if kinds != ["embedding"] + ["block"] * self.n_layer + ["head"]:
            raise ValueError(
                f"profile of '{self.model}': units must be embedding, {self.n_layer} blocks, head "
                f"(n_layer={self.n_layer}); got {', '.join(kinds) or 'none'}"
            )
        for u in self.units:
            for key in ("forward_s", "backward_s", "step_s", "activation_bytes", "param_bytes"):
                v = getattr(u, key)
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                    raise ValueError(f"profile unit {u.name}: {key}={v!r} must be a number >= 0")

    @property
    def embedding(self) -> LayerProfile:
        return self.units[0]

    @property
    def blocks(self) -> list[LayerProfile]:
        return self.units[1:-1]

    @property
    def head(self) -> LayerProfile:
        return self.units[-1]

    def stage_units(self, layers_per_stage: Sequence[int]) -> list[list[LayerProfile]]:
        """The units of each stage of a split: its blocks, plus the embedding on the first
        stage and the head on the last."""
        out, i = [], 0
        for s, n in enumerate(layers_per_stage):
            units = list(self.blocks[i : i + n])
            if s == 0:
                units.insert(0, self.embedding)
            if s == len(layers_per_stage) - 1:
                units.append(self.head)
            out.append(units)
            i += n
        return out

    def message_bytes(self) -> int:
        """One hidden-state tensor between two stages (microbatch x seq_len x n_embd)."""
        return self.microbatch_size * self.seq_len * self.n_embd * self.dtype_bytes

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict:
        d = asdict(self)
        return {"format": FORMAT, "version": VERSION, **d}

    @classmethod
    def from_dict(cls, d: Mapping) -> "ModelProfile":
        if d.get("format") != FORMAT or d.get("version") != VERSION:
            raise ValueError(
                f"not a {FORMAT} version {VERSION} file (format={d.get('format')!r}, version={d.get('version')!r})"
            )
        body = {k: v for k, v in d.items() if k not in ("format", "version")}
        body["units"] = [LayerProfile(**u) for u in body["units"]]
        return cls(**body)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise WriteFailed(path, err) from None
        return write_aside(path, json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "ModelProfile":
        try:
            data = json.loads(Path(path).read_text())
            return cls.from_dict(data)
        except (OSError, json.JSONDecodeError, TypeError, KeyError, ValueError) as err:
            raise ValueError(f"profile file {path}: {err}") from None


def load_profile(profile: "ModelProfile | str | Path", key: str = "partition.profile") -> ModelProfile:
    """A profile object as is, or one read from a path; ``key`` names the config key in errors."""
    if isinstance(profile, ModelProfile):
        return profile
    if profile is None:
        raise ValueError(f"{key}=null: a profile file is needed (profile.json from pipeflow.models.profiler)")
    if not Path(profile).is_file():
        raise ValueError(f"{key}={profile}: no such file; give the path of a profile.json")
    try:
        return ModelProfile.load(profile)
    except ValueError as err:
        raise ValueError(f"{key}={profile}: {err}") from None


# --------------------------------------------------------------------------- partition


def stage_costs(
    profile: ModelProfile, layers_per_stage: Sequence[int]
) -> tuple[list[float], list[float]]:
    """Per stage: forward + backward seconds, and modelled peak memory in bytes (module doc)."""
    p = len(layers_per_stage)
    times, memory = [], []
    for s, units in enumerate(profile.stage_units(layers_per_stage)):
        times.append(sum(u.time_s for u in units))
        memory.append(
            (p - s) * sum(u.activation_bytes for u in units) + MODEL_STATE_FACTOR * sum(u.param_bytes for u in units)
        )
    return times, memory


def partition_profile(profile: ModelProfile, stages: int, memory_limit: float | None = None) -> list[int]:
    """Blocks per stage minimising the slowest stage's forward + backward seconds, every stage's
    modelled peak memory <= ``memory_limit`` bytes (None: no limit); of those the most even,
    ties to more blocks on earlier stages (exact: two dynamic programs). ValueError naming
    ``partition.memory_limit`` when no split fits."""
    n = profile.n_layer
    check_stage_count(stages, n)
    if memory_limit is not None and (
        isinstance(memory_limit, bool) or not isinstance(memory_limit, (int, float)) or not memory_limit > 0
    ):
        raise ValueError(f"partition.memory_limit={memory_limit!r}: must be a number of bytes > 0, or null")
    splits = _Splits(profile, stages, memory_limit)
    bound = splits.minmax(splits.time, splits.fits)[0][0]
    if bound is None:
        # nothing fits: report how far the least memory-hungry split is from the limit
        peak = splits.minmax(splits.memory, lambda s, i, j: True)[0][0]
        over = peak - memory_limit
        raise ValueError(
            f"partition.memory_limit={memory_limit:g}: no split of {n} blocks into {stages} stages fits; "
            f"the smallest possible peak stage memory is {peak:.0f} bytes, {over:.0f} bytes "
            f"({over / memory_limit:.1%}) over the limit"
        )
    return splits.most_even(bound)


class _Splits:
    """The contiguous splits of a profile's blocks into ``stages`` stages, stage s on blocks
    [i, j) priced from sums over the blocks (time and modelled peak memory)."""

    def __init__(self, profile: ModelProfile, stages: int, memory_limit: float | None) -> None:
        self.n, self.stages, self.last, self.memory_limit = profile.n_layer, stages, stages - 1, memory_limit
        self.emb, self.head = profile.embedding, profile.head
        self.t_pre, self.a_pre, self.w_pre = [0.0], [0], [0]
        for u in profile.blocks:
            self.t_pre.append(self.t_pre[-1] + u.time_s)
            self.a_pre.append(self.a_pre[-1] + u.activation_bytes)
            self.w_pre.append(self.w_pre[-1] + u.param_bytes)

    def time(self, s: int, i: int, j: int) -> float:
        t = self.t_pre[j] - self.t_pre[i]
        if s == 0:
            t += self.emb.time_s
        if s == self.last:
            t += self.head.time_s
        return t

    def memory(self, s: int, i: int, j: int) -> float:
        act, par = self.a_pre[j] - self.a_pre[i], self.w_pre[j] - self.w_pre[i]
        if s == 0:
            act, par = act + self.emb.activation_bytes, par + self.emb.param_bytes
        if s == self.last:
            act, par = act + self.head.activation_bytes, par + self.head.param_bytes
        return (self.stages - s) * act + MODEL_STATE_FACTOR * par

    def fits(self, s: int, i: int, j: int) -> bool:
        return self.memory_limit is None or self.memory(s, i, j) <= self.memory_limit

    def ends(self, s: int, i: int) -> range:
        """Where stage s starting at block i may end: at least one block left for every later stage."""
        return range(i + 1, self.n - (self.last - s) + 1)

    def minmax(self, cost, allowed) -> list[list]:
        """table[s][i]: the smallest largest-stage ``cost`` of blocks [i, n) on stages s..
        (None: no split whose stages are all ``allowed``)."""
        n, last = self.n, self.last
        table = [[None] * (n + 1) for _ in range(self.stages + 1)]
        table[self.stages][n] = 0
        for s in range(last, -1, -1):
            for i in range(s, n - (last - s)):
                opts = [max(cost(s, i, j), table[s + 1][j]) for j in self.ends(s, i)
                        if table[s + 1][j] is not None and allowed(s, i, j)]
                table[s][i] = min(opts) if opts else None
        return table

    def most_even(self, bound: float) -> list[int]:
        """Blocks per stage of the split, of those whose stages all fit and take at most
        ``bound``, with the smallest sum of squared stage times; ties to more blocks on
        earlier stages."""
        n, last = self.n, self.last

        def ok(s: int, i: int, j: int) -> bool:
            return self.fits(s, i, j) and self.time(s, i, j) <= bound

        squares = [[None] * (n + 1) for _ in range(self.stages + 1)]
        squares[self.stages][n] = 0.0
        for s in range(last, -1, -1):
            for i in range(s, n - (last - s)):
                opts = [self.time(s, i, j) ** 2 + squares[s + 1][j] for j in self.ends(s, i)
                        if squares[s + 1][j] is not None and ok(s, i, j)]
                squares[s][i] = min(opts) if opts else None
        layers, i = [], 0
        for s in range(self.stages):
            # the largest stage s reaching the optimum (the same expression as the table's
            # entry, so the float comparison is exact): ties to earlier stages
            j = max(j for j in self.ends(s, i)
                    if squares[s + 1][j] is not None and ok(s, i, j)
                    and self.time(s, i, j) ** 2 + squares[s + 1][j] == squares[s][i])
            layers.append(j - i)
            i = j
        return layers
