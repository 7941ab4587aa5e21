"""Layer partitioners: ``layers_per_stage``, whole numbers >= 1 adding up to ``n_layer``
(stage s holds blocks ``[sum(layers[:s]), sum(layers[:s+1]))``, the first also the
embedding, the last the final norm and head). ``uniform``: as even as possible;
``parameters``: the cut whose largest stage holds the fewest parameters, embedding and
head counted (:func:`by_parameters`); ``profiled``: from a measured profile
(:func:`pipeflow.planning.layer_profile.partition_profile`)."""

from __future__ import annotations

from typing import Mapping, Sequence

from .layer_profile import check_stage_count, load_profile, partition_profile
from .transformer import TransformerSpec, embedding_params, head_params, layer_params

PARTITIONERS = ("uniform", "parameters", "profiled")


def uniform(n_layer: int, stages: int) -> list[int]:
    """Layers per stage as even as possible; the first stages take the remainder."""
    if isinstance(n_layer, bool) or not isinstance(n_layer, int) or n_layer < 1:
        raise ValueError(f"model.n_layer={n_layer!r}: must be a whole number >= 1")
    check_stage_count(stages, n_layer)
    base, extra = divmod(n_layer, stages)
    return [base + (1 if s < extra else 0) for s in range(stages)]


def by_parameters(layer_params: Sequence[int], first_extra: int, last_extra: int, stages: int) -> list[int]:
    """The contiguous split of ``layer_params`` into ``stages`` non-empty stages minimising the
    largest stage's parameters (stage 0 also holds ``first_extra``, the last ``last_extra``);
    of those, the smallest sum of squared stage sizes, ties to more layers on earlier stages,
    so equal layers and no extras give :func:`uniform`'s split. Exact, O(stages * n_layer^2)."""
    sizes = list(layer_params)
    n = len(sizes)
    if n == 0:
        raise ValueError("model.n_layer=0: a partition needs at least one layer")
    for key, value in [("layer_params", v) for v in sizes] + [("first_extra", first_extra), ("last_extra", last_extra)]:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{key}={value!r}: parameter counts must be whole numbers >= 0")
    check_stage_count(stages, n)

    prefix = [0]
    for p in sizes:
        prefix.append(prefix[-1] + p)

    def load(s: int, i: int, j: int) -> int:
        """Parameters of stage s holding layers [i, j)."""
        return (
            prefix[j] - prefix[i]
            + (first_extra if s == 0 else 0)
            + (last_extra if s == stages - 1 else 0)
        )

    def ends(s: int, i: int) -> range:
        # stage s starting at layer i may end anywhere that leaves one layer per later stage
        return range(i + 1, n - (stages - 1 - s) + 1)

    # best[s][i]: the optimum for layers [i, n) over stages s..stages-1; filled backwards
    # so the forward walk below can read every stage's options.
    INF = None
    worst = [[INF] * (n + 1) for _ in range(stages + 1)]
    worst[stages][n] = 0
    for s in range(stages - 1, -1, -1):
        for i in range(s, n - (stages - 1 - s)):
            worst[s][i] = min(max(load(s, i, j), worst[s + 1][j]) for j in ends(s, i) if worst[s + 1][j] is not INF)
    bound = worst[0][0]

    squares = [[INF] * (n + 1) for _ in range(stages + 1)]
    squares[stages][n] = 0
    for s in range(stages - 1, -1, -1):
        for i in range(s, n - (stages - 1 - s)):
            options = [
                load(s, i, j) ** 2 + squares[s + 1][j]
                for j in ends(s, i)
                if squares[s + 1][j] is not INF and load(s, i, j) <= bound
            ]
            squares[s][i] = min(options) if options else INF

    layers, i = [], 0
    for s in range(stages):
        # the largest stage s that still reaches the optimum: ties to earlier stages
        j = max(
            j
            for j in ends(s, i)
            if squares[s + 1][j] is not INF
            and load(s, i, j) <= bound
            and load(s, i, j) ** 2 + squares[s + 1][j] == squares[s][i]
        )
        layers.append(j - i)
        i = j
    return layers


def partition_layers(name: str, spec: TransformerSpec, stages: int, options: Mapping | None = None) -> list[int]:
    """Layers per stage by the partitioner the ``partition`` config group names;
    ``options`` is that group (``profiled`` reads its ``profile`` and ``memory_limit``)."""
    if name == "uniform":
        return uniform(spec.n_layer, stages)
    if name == "parameters":
        # head_params counts the last stage's copy of the tied embedding; with one stage
        # the split is forced anyway, so the double count never matters.
        return by_parameters([layer_params(spec)] * spec.n_layer, embedding_params(spec), head_params(spec), stages)
    if name == "profiled":
        options = options or {}
        profile = load_profile(options.get("profile"), key="partition.profile")
        if profile.n_layer != spec.n_layer:
            raise ValueError(
                f"partition.profile={options.get('profile')}: it profiles {profile.n_layer} blocks but "
                f"model.n_layer={spec.n_layer}; profile this model again"
            )
        return partition_profile(profile, stages, options.get("memory_limit"))
    raise ValueError(f"partition.name={name}: unknown partitioner; allowed values: {', '.join(PARTITIONERS)}")
