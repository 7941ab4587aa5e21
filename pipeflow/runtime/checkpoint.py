"""Checkpoints that do not depend on the layout that wrote them: every parameter saved once,
whole, under its single-device name, beside its AdamW moments and step; each rank writes
``rank<r>.pt``, rank 0 ``meta.json`` and ``latest``, and a run resumes under any layout
(docs/training.md, "Checkpoints and resuming";
:func:`pipeflow.formats.checkpoint_folder.verify` checks one without torch)."""

from __future__ import annotations

import json
import os
from pathlib import Path

# the checkpoint folder's layout and its torch-free reading (the up-front check's)
from ..faults import Fault
from ..formats.checkpoint_folder import LATEST, META, read_meta, resolve, verify  # noqa: F401 - re-exported
from ..formats.checkpoint_folder import step_dir as _step_dir
from . import watch
from .sharded import ShardedAdamW, whole_weights

# torch is imported where it is used

FORMAT = 2


class CheckpointError(Fault, OSError):
    """A checkpoint that cannot be written or read, in one sentence naming the path."""


def _write(path: Path, write) -> None:
    """Write ``path`` through ``write(file)`` to a temporary name, then rename: a full
    disk or a crash leaves no cut-short file under the real name."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except (OSError, RuntimeError) as err:
        tmp.unlink(missing_ok=True)
        # torch.save's zip writer reports a full disk as a RuntimeError over the OSError
        cause = err if isinstance(err, OSError) else err.__context__
        if not isinstance(cause, OSError):
            raise
        raise CheckpointError(f"could not write the checkpoint file {path}: {cause.strerror or cause}") from None


# ---------------------------------------------------------------- names and owners

def _held(stages: dict) -> list:
    """This rank's (pipe, stage), state in stage order: the order of every collective here."""
    return sorted(stages.items(), key=lambda kv: (kv[0][1], kv[0][0]))


def _named(st) -> list[tuple[str, object]]:
    """(the model's name, parameter) of a stage's trained parameters (a later copy of a
    tied embedding among them: :func:`_aliases` tells it apart)."""
    return [(name, p) for name, p in st.module.named_parameters() if p.requires_grad]


def _aliases(st) -> dict[int, int]:
    """id(parameter) -> the index among the stage's tied copies, for a copy that is not
    the first stage's (saved as the first stage's, loaded from it)."""
    if st.first:
        return {}
    return {id(p): i for i, p in enumerate(st.tied)}


def _writer(schedule, pipe: int, stage: int, device: int) -> bool:
    """Whether this replica of ``stage`` writes it: the lowest pipe on the stage's owner device."""
    from ..schedules.zero import zero_owners

    placement = schedule.placement
    owner = zero_owners(placement)[stage] if schedule.zero else placement.device(0, stage)
    pipes = [p for p, d in placement.replicas(stage) if d == owner]
    return device == owner and pipe == min(pipes)


def _tp(st):
    return getattr(st.module, "tp", None)


def _whole(p, tensor, tp):
    """``tensor`` shaped as the piece ``p`` is, whole (tensor parallelism: gathered)."""
    from ..models.tensor_parallel import whole_gradient

    return tensor if tp is None else whole_gradient(p, tensor, tp)


def _piece(p, whole, tp):
    """This rank's piece of ``whole`` as parameter ``p`` is cut (the inverse of :func:`_whole`)."""
    import torch

    split = getattr(p, "_tp_split", None)
    if tp is None or split is None:
        return whole
    dim, blocks, heads = split
    if heads is not None and heads < tp.size:  # replicated key/value heads: this rank's group's head
        return whole.chunk(heads, dim)[tp.rank * heads // tp.size]
    return torch.cat([c.chunk(tp.size, dim)[tp.rank] for c in whole.chunk(blocks, dim)], dim)


# a GPT's or a BERT's tables with a row a word (model.vocab_multiple pads them; the padding is zero)
VOCABULARY_TABLES = ("wte.weight", "lm_head.weight", "embeddings.word_embeddings.weight", "cls.decoder.weight",
                     "cls.bias")


def _vocabulary_rows(name: str, whole, rows: int | None):
    """``whole`` as this run's vocabulary table ``name`` holds it: the zero rows past the words
    trimmed or added for another ``model.vocab_multiple``."""
    if rows is None or name not in VOCABULARY_TABLES or whole.size(0) == rows:
        return whole
    fitted = whole.new_zeros((rows, *whole.shape[1:]))
    fitted[:min(rows, whole.size(0))] = whole[:rows]
    return fitted


# ---------------------------------------------------------------- optimizer state by parameter

def _moments(st) -> dict[int, tuple]:
    """id(parameter) -> (exp_avg, exp_avg_sq, step) as this rank holds it (a tensor piece under
    tensor parallelism; a sharded optimizer's gathered: a collective of the replicas)."""
    opt, out = st.optimizer, {}
    if opt is None:
        return out
    plain = [opt] if not isinstance(opt, ShardedAdamW) else ([opt.tied] if opt.tied is not None else [])
    for o in plain:
        for p, s in o.state.items():
            if "exp_avg" in s:
                out[id(p)] = (s["exp_avg"], s["exp_avg_sq"], int(float(s["step"])))
    if isinstance(opt, ShardedAdamW):
        out.update(_sharded_moments(opt))
    return out


def _sharded_moments(opt: ShardedAdamW) -> dict[int, tuple]:
    import torch

    out = {}
    for i, group in enumerate(opt.param_groups):
        total, share, start = opt.shard(group)
        if not total or opt.moments[i] is None:
            continue
        flats = []
        for m in opt.moments[i]:
            flat = torch.zeros(share * opt.n, dtype=m.dtype, device=m.device)
            flat[start:start + share].copy_(m)
            opt._all_gather(flat, start, share)
            flats.append(flat)
        at = 0
        for p in group["params"]:
            out[id(p)] = tuple(f[at:at + p.numel()].view_as(p) for f in flats) + (opt.steps,)
            at += p.numel()
    return out


def _set_moments(st, state: dict) -> None:
    """Put ``state`` (id(parameter) -> (exp_avg, exp_avg_sq, step), this rank's pieces)
    into the stage's optimizer; a sharded optimizer takes its replica's share."""
    import torch

    opt = st.optimizer
    if opt is None:
        return
    plain = [opt] if not isinstance(opt, ShardedAdamW) else ([opt.tied] if opt.tied is not None else [])
    for o in plain:
        for group in o.param_groups:
            for p in group["params"]:
                if id(p) in state:
                    ea, eas, step = state[id(p)]
                    o.state[p] = {"step": torch.tensor(float(step)), "exp_avg": ea.to(p.dtype).clone(),
                                  "exp_avg_sq": eas.to(p.dtype).clone()}
    if not isinstance(opt, ShardedAdamW):
        return
    for i, group in enumerate(opt.param_groups):
        total, share, start = opt.shard(group)
        params = group["params"]
        if not total or not any(id(p) in state for p in params):
            continue
        moments = []
        for k in (0, 1):
            flat = torch.zeros(share * opt.n, dtype=params[0].dtype, device=params[0].device)
            at = 0
            for p in params:
                if id(p) in state:
                    flat[at:at + p.numel()] = state[id(p)][k].reshape(-1)
                at += p.numel()
            moments.append(flat[start:start + share].clone())
        opt.moments[i] = tuple(moments)
        opt.steps = max(state[id(p)][2] for p in params if id(p) in state)


# ---------------------------------------------------------------- saving

def save(run_dir: str, step: int, rank: int, stages: dict, meta: dict, chunk_start: int | None = None,
         scaler=None, schedule=None, device: int | None = None) -> None:
    """Write this rank's part of the checkpoint of ``step``: the stages' parameters and
    optimizer state by name where this rank writes them; every rank joins the gathers.
    ``device``: this rank's device in ``schedule``."""
    with whole_weights(stages), watch.paused():  # (a large model's write is one long call)
        _save(run_dir, step, rank, stages, meta, chunk_start, scaler, schedule, rank if device is None else device)


def _save(run_dir, step, rank, stages, meta, chunk_start, scaler, schedule, device) -> None:
    import torch
    import torch.distributed as dist

    d = _step_dir(run_dir, step)
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise CheckpointError(f"could not create the checkpoint folder {d}: {err.strerror or err}") from None
    params, optim = {}, {}
    for (pipe, stage), st in _held(stages):
        tp = _tp(st)
        writes = _writer(schedule, pipe, stage, device) and (tp is None or tp.rank == 0)
        aliases = _aliases(st)
        moments = _moments(st)
        for name, p in _named(st):
            whole = _whole(p, p.detach(), tp)  # (every tensor rank joins, the writer keeps)
            held = moments.get(id(p))
            ea = _whole(p, held[0], tp) if held else None
            eas = _whole(p, held[1], tp) if held else None
            if not writes or id(p) in aliases:
                continue
            params[name] = whole.detach().cpu().clone()
            if held:
                optim[name] = {"exp_avg": ea.cpu().clone(), "exp_avg_sq": eas.cpu().clone(), "step": held[2]}
    state = {"step": step, "format": FORMAT, "meta": meta, "params": params, "optim": optim}
    # what only this layout can use: an asynchronous schedule's weight versions still
    # needed after the flush (2BW's previous version), by (pipe, stage)
    versions = {f"{pipe}:{stage}": {"live": st.versions.live, "stash": st.versions.stash}
                for (pipe, stage), st in stages.items() if getattr(st, "versions", None) is not None}
    if versions:
        state["versions"] = versions
    if scaler is not None:
        state["loss_scaler"] = scaler.state_dict()
    path = d / f"rank{rank}.pt"
    _write(path, lambda f: torch.save(state, f))
    told = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object((path.stat().st_size, sorted(params)), told, dst=0)
    if rank == 0:
        record = {"step": step, "format": FORMAT, "chunk_start": step if chunk_start is None else chunk_start,
                  "world_size": len(told), "meta": meta,
                  "files": {f"rank{r}.pt": size for r, (size, _) in enumerate(told)},
                  "names": {f"rank{r}.pt": names for r, (_, names) in enumerate(told) if names}}
        _write(d / META, lambda f: f.write((json.dumps(record, indent=2) + "\n").encode()))
        _write(Path(run_dir) / "checkpoints" / LATEST, lambda f: f.write(f"{step}\n".encode()))


# ---------------------------------------------------------------- loading

LAYOUT = ("schedule", "stages", "world_size", "layers_per_stage", "placement", "shard", "tensor_parallel")


def load(resume: str, rank: int, stages: dict, meta: dict, step: int | None = None, scaler=None) -> int:
    """Load the checkpoint ``resume`` names (or that run's at ``step``) into this rank's
    ``stages``, cut as this layout cuts them; fp16's loss scale into ``scaler``. Returns the
    checkpoint's step."""
    with whole_weights(stages), watch.paused():
        return _load(resume, rank, stages, meta, step, scaler)


def _load(resume, rank, stages, meta, step, scaler) -> int:
    import torch

    folder, found = resolve(resume)
    if step is not None and step != found:
        folder, found = _step_dir(folder.parent.parent, step), step
    record = read_meta(folder, resume)
    if record.get("format") != FORMAT:
        return _load_same_layout(folder, found, rank, stages, meta, scaler, resume)
    same = all(record["meta"].get(k) == meta.get(k) for k in LAYOUT)
    files = {name: torch.load(folder / name, map_location="cpu", weights_only=False, mmap=True)
             for name in record.get("names", {})}
    params = {n: t for f in files.values() for n, t in f["params"].items()}
    optim = {n: s for f in files.values() for n, s in f["optim"].items()}
    first_tied = _first_tied_names(stages)
    for _, st in _held(stages):
        tp = _tp(st)
        aliases = _aliases(st)
        rows = getattr(getattr(st.module, "config", None), "vocab_size", None)
        state = {}
        with torch.no_grad():
            for name, p in _named(st):
                source = first_tied[aliases[id(p)]] if id(p) in aliases else name
                if source not in params:
                    raise ValueError(f"resume={resume}: the checkpoint holds no parameter {source}")

                def whole(t, source=source, p=p):
                    return _piece(p, _vocabulary_rows(source, t, rows), tp)

                p.copy_(whole(params[source]).to(p.dtype))
                if source in optim:
                    s = optim[source]
                    state[id(p)] = (whole(s["exp_avg"]), whole(s["exp_avg_sq"]), int(s["step"]))
        _set_moments(st, state)
    own = torch.load(folder / f"rank{rank}.pt", map_location="cpu", weights_only=False, mmap=True) \
        if same and (folder / f"rank{rank}.pt").exists() else {}
    for (pipe, stage), st in stages.items():
        saved_versions = own.get("versions", {}).get(f"{pipe}:{stage}")
        if saved_versions is not None and getattr(st, "versions", None) is not None:
            st.versions.live = saved_versions["live"]
            st.versions.stash = dict(saved_versions["stash"])
    scaled = next((f["loss_scaler"] for f in files.values() if "loss_scaler" in f), None)
    if scaler is not None and scaled is not None:
        scaler.load_state_dict(scaled)
    return found


def _first_tied_names(stages: dict) -> list[str]:
    """The first stage's names of its tied copies, in order: a later copy loads from them
    (a collective: the rank holding the first stage tells the others)."""
    import torch.distributed as dist

    mine = None
    for st in stages.values():
        if st.first:
            names = {id(p): n for n, p in _named(st)}
            mine = [names[id(t)] for t in st.tied]
    told = [None] * dist.get_world_size()
    dist.all_gather_object(told, mine)
    return next((t for t in told if t is not None), [])


def _load_same_layout(folder, found, rank, stages, meta, scaler, resume) -> int:
    """A checkpoint of the earlier format: each rank's stages' state dicts, which load
    only into the layout that wrote them."""
    import torch

    state = torch.load(folder / f"rank{rank}.pt", map_location="cpu", weights_only=False)
    saved = state["meta"]
    for key in LAYOUT[:-1]:
        if saved.get(key, "none" if key == "shard" else None) != meta.get(key):  # (shard: unsharded before it was recorded)
            raise ValueError(
                f"resume={resume}: the checkpoint (written before checkpoints moved between layouts) was written "
                f"with {key}={saved.get(key)}, this run has {key}={meta.get(key)}; resume it with the same pipeline "
                f"configuration"
            )
    for (pipe, stage), st in stages.items():
        st.module.load_state_dict(state["stages"][f"{pipe}:{stage}"])
        if st.optimizer is not None:
            st.optimizer.load_state_dict(state["optimizers"][f"{pipe}:{stage}"])
        saved_versions = state.get("versions", {}).get(f"{pipe}:{stage}")
        if saved_versions is not None and getattr(st, "versions", None) is not None:
            st.versions.live = saved_versions["live"]
            st.versions.stash = dict(saved_versions["stash"])
    if scaler is not None and "loss_scaler" in state:
        scaler.load_state_dict(state["loss_scaler"])
    return found
