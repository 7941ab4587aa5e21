"""``pipeline.tensor_parallel`` and ``pipeline.sequence_parallel``: what a run with tensor
parallelism needs of its schedule and its model, checked once for every app
(pipeflow-simulate's prepare_simulation and pipeflow-train's prepare_training).

Each schedule device is a group of T ranks that split its stages Megatron style
(pipeflow.models.tensor_parallel): whole attention heads and a slice of the MLP's width
per rank, and with sequence parallelism a slice of each (segment of the) sequence.
"""

from __future__ import annotations

from typing import Any, Sequence

from pipeflow.schedules.ir import Schedule, WeightPolicy

from .values import ConfigError


def tensor_degree(cfg: Any) -> tuple[int, bool]:
    """(T, sequence parallel) of a composed config; (1, False) where the keys are absent."""
    pipe = cfg["pipeline"]
    return int(pipe.get("tensor_parallel", 1) or 1), bool(pipe.get("sequence_parallel", False))


def check_tensor_parallel(T: int, sp: bool, schedule: Schedule | None, spec, lengths: Sequence[int] | None) -> None:
    """Raise ConfigError, one sentence naming ``pipeline.tensor_parallel`` (or
    ``pipeline.sequence_parallel``), where T ranks (``sp``: with sequence parallelism)
    cannot split the run: an asynchronous schedule, a branched model, heads, key/value
    heads or the MLP's width that do not split into T, and with sequence parallelism a
    sequence or a segment whose tokens do not. ``spec`` is the model's TransformerSpec
    (None for a branched model), ``lengths`` the segment lengths (None: whole sequences).
    Nothing to check at T = 1."""
    if T == 1:
        return
    key = f"pipeline.tensor_parallel={T}"
    if spec is None:
        raise ConfigError(f"{key}: a concurrent-branch model's stages (vision and text branches, their "
                          f"interaction) are not split across tensor-parallel ranks; allowed values: 1")
    if schedule is not None and (schedule.policy != WeightPolicy.SYNC or schedule.windows > 1):
        raise ConfigError(f"{key}: schedule '{schedule.name}' updates weights asynchronously "
                          f"(policy {schedule.policy.value}), and a tensor group's ranks split each update's "
                          f"collectives in lockstep only within a synchronous step; use a synchronous schedule "
                          f"(gpipe, 1f1b, zb_h1, ...) or pipeline.tensor_parallel=1")
    if spec.n_head % T:
        raise ConfigError(f"{key}: model '{spec.name}' has {spec.n_head} attention heads (model.n_head), which "
                          f"do not split into {T} ranks of whole heads; use a T that divides {spec.n_head}")
    kv = spec.kv_heads
    if kv % T and T % kv:
        raise ConfigError(f"{key}: model '{spec.name}' has {kv} key/value heads (model.n_kv_head): T must divide "
                          f"them (each rank its own) or be a multiple of them (each head on T/{kv} ranks)")
    if spec.ffn_width % T:
        raise ConfigError(f"{key}: model '{spec.name}''s MLP width {spec.ffn_width} (model.n_inner) does not "
                          f"split into {T} column-parallel slices; use a T that divides it")
    if not sp:
        return
    if spec.seq_len % T:
        raise ConfigError(f"pipeline.sequence_parallel=true: model.seq_len={spec.seq_len} tokens do not split "
                          f"across pipeline.tensor_parallel={T} ranks; use a seq_len that T divides")
    for i, n in enumerate(lengths or ()):
        if n % T:
            raise ConfigError(f"pipeline.sequence_parallel=true: sequence segment {i} has {n} tokens "
                              f"(segments {list(lengths)}), which do not split across pipeline.tensor_parallel={T} "
                              f"ranks; use segments of multiples of {T} tokens (schedule.split=uniform with "
                              f"model.seq_len a multiple of pipeline.segments x {T}, or in pipeflow-simulate "
                              f"cost.segment_lengths)")


def grouped_topology(spec, topology, tensor: int, sequence_parallel: bool):
    """``topology`` seen as tensor groups of ``tensor`` GPUs for the model ``spec``
    (:func:`pipeflow.topology.tensor.tensor_topology`), or the sentence saying why the
    model (:func:`check_tensor_parallel`) or the nodes refuse that degree: the planner's
    and the search's question for each degree they try."""
    from pipeflow.topology.tensor import tensor_topology

    try:
        check_tensor_parallel(tensor, sequence_parallel, None, spec, None)
        return tensor_topology(topology, tensor)
    except (ConfigError, ValueError) as err:
        return str(err)
