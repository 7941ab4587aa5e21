"""Measure a GPT's (or hf_causal decoder's) layer sequence on this machine, the input of
the ``profiled`` partitioner and cost model (:mod:`pipeflow.planning.layer_profile`). Each
unit (embedding, each block, head with its loss) is a stage as the runtime cuts it; per
unit the forward, backward and AdamW times (medians), the bytes autograd saves, and the
parameter bytes. ``python -m pipeflow.profile --out profile.json``."""

from __future__ import annotations

import statistics
import time
from typing import Callable, Mapping

import torch
from torch import nn

from pipeflow.planning.layer_profile import LayerProfile, ModelProfile

from .gpt import GPTStage, gpt2_config, lm_loss


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_time(fn: Callable[[], None], device: torch.device, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _units(model_cfg: Mapping, seed: int) -> list[tuple[str, str, nn.Module]]:
    """(name, kind, module) for the embedding, each block and the head, cut as the runtime cuts."""
    if model_cfg.get("family") == "hf_causal":
        return _hf_units(model_cfg, seed)
    config = gpt2_config(model_cfg)
    n, attention = config.n_layer, model_cfg.get("attention") or "sdpa"
    # a one-block first stage minus its block is the embedding alone; its forward is GPTStage's own
    emb = GPTStage(config, 0, 1, first=True, last=False, seed=seed, attention=attention)
    emb.h = nn.ModuleDict()
    units = [("embedding", "embedding", emb)]
    for i in range(n):
        units.append((f"block.{i}", "block",
                      GPTStage(config, i, i + 1, first=False, last=False, seed=seed, attention=attention)))
    head = GPTStage(config, n - 1, n, first=False, last=True, seed=seed, attention=attention)
    head.h = nn.ModuleDict()
    units.append(("head", "head", head))
    return units


def _hf_units(model_cfg: Mapping, seed: int) -> list[tuple[str, str, nn.Module]]:
    """The same units of a Hugging Face decoder (model.family=hf_causal): its stage model
    holding one layer, or none (the embedding; the final norm and head)."""
    from .hf_causal import HFCausalStage, load_hf_config

    config = load_hf_config(model_cfg)
    n, attention = config.num_hidden_layers, model_cfg.get("attention") or "sdpa"

    def bare(stage: HFCausalStage) -> HFCausalStage:
        setattr(stage._base, stage.arch.layers, nn.ModuleDict())
        return stage

    def stage(lo: int, first: bool = False, last: bool = False) -> HFCausalStage:
        return HFCausalStage(config, lo, lo + 1, first=first, last=last, seed=seed, attention=attention)

    units: list[tuple[str, str, nn.Module]] = [("embedding", "embedding", bare(stage(0, first=True)))]
    for i in range(n):
        units.append((f"block.{i}", "block", stage(i)))
    units.append(("head", "head", bare(stage(n - 1, last=True))))
    return units


def profile_model(
    model_cfg: Mapping,
    microbatch_size: int,
    seq_len: int | None = None,
    seed: int = 0,
    device: str | torch.device = "cpu",
    threads: int | None = 1,
    warmup: int = 2,
    repeats: int = 5,
) -> ModelProfile:
    """Profile every unit of the configured GPT (or hf_causal decoder) for one microbatch of ``microbatch_size``
    sequences of ``seq_len`` tokens (default: model.seq_len), with ``threads`` intra-op
    threads (the runtime's runtime.threads_per_rank; None: leave torch's setting)."""
    device = torch.device(device)
    seq_len = int(seq_len if seq_len is not None else model_cfg["seq_len"])
    vocab, n_embd = int(model_cfg["vocab_size"]), int(model_cfg["n_embd"])
    old_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (microbatch_size, seq_len), generator=gen).to(device)
    targets = torch.randint(0, vocab, (microbatch_size, seq_len), generator=gen).to(device)
    hidden = torch.randn(microbatch_size, seq_len, n_embd, generator=gen).to(device)
    profiled = []
    try:
        for name, kind, module in _units(model_cfg, seed):
            profiled.append(_profile_unit(name, kind, module.to(device), device, ids, targets, hidden, warmup, repeats))
    finally:
        torch.set_num_threads(old_threads)
    return ModelProfile(
        model=str(model_cfg.get("name", "gpt")),
        n_layer=int(model_cfg["n_layer"]),
        n_embd=n_embd,
        vocab_size=vocab,
        seq_len=seq_len,
        microbatch_size=int(microbatch_size),
        units=profiled,
        device=str(device),
        threads=torch.get_num_threads() if threads is None else int(threads),
        meta={"warmup": warmup, "repeats": repeats, "torch": torch.__version__},
    )


def _profile_unit(name: str, kind: str, module: nn.Module, device: torch.device, ids: torch.Tensor,
                  targets: torch.Tensor, hidden: torch.Tensor, warmup: int, repeats: int) -> LayerProfile:
    """One unit's forward, backward and optimizer step times (medians of ``repeats`` after
    ``warmup``), the bytes autograd saves in its forward and its parameter bytes."""
    module.train()
    params = [p for p in module.parameters() if p.requires_grad]
    param_ptrs = {p.untyped_storage().data_ptr() for p in params}
    saved: dict[int, int] = {}
    normalizer = float(targets.numel())

    def pack(t: torch.Tensor) -> torch.Tensor:
        # one storage may back several saved views; parameters are not activations
        ptr = t.untyped_storage().data_ptr()
        if ptr not in param_ptrs:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    def forward():
        # the embedding takes token ids; every other unit a hidden state that
        # needs a gradient, as a received activation does in the runtime
        x = ids if kind == "embedding" else hidden.detach().requires_grad_(True)
        out = module(x)
        if kind == "head":
            out = lm_loss(out, targets, normalizer, getattr(module, "vocab", None))
        return out

    def backward_of(out):
        if out.dim() == 0:
            out.backward()
        else:
            out.backward(grad)

    with torch.no_grad():
        grad = torch.randn_like(hidden)
    fwd_s = _median_time(forward, device, warmup, repeats)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    activation = sum(saved.values())
    backward_of(out)

    # backward alone: a fresh forward (untimed) before each timed backward
    bwd_times = []
    for r in range(warmup + repeats):
        out = forward()
        _sync(device)
        t0 = time.perf_counter()
        backward_of(out)
        _sync(device)
        if r >= warmup:
            bwd_times.append(time.perf_counter() - t0)
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    step_s = _median_time(optimizer.step, device, warmup, repeats)
    module.zero_grad(set_to_none=True)
    return LayerProfile(
        name=name,
        kind=kind,
        forward_s=fwd_s,
        backward_s=statistics.median(bwd_times),
        activation_bytes=int(activation),
        param_bytes=int(sum(p.numel() * p.element_size() for p in params)),
        step_s=step_s,
    )
