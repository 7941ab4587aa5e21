"""The host's own time per transformer block, what a device profile's operators leave out:
the model's Python, the dispatcher's calls that launch nothing, autograd's walk. F, B, I
and W of one block as a middle stage, one microbatch of ``TOKENS`` tokens on the CPU,
with the runtime's own code; :mod:`pipeflow.planning.device_profile` adds it per block,
less the kernels' launches it prices (docs/simulation.md, "What a CPU step adds")."""

from __future__ import annotations

import statistics
import time
from typing import Callable, Mapping

import torch

from ..families import FAMILIES
from .backward import accumulators, backward_input, backward_weight
from .saved_bytes import SavedBytes

TOKENS = 8  # one microbatch of this many tokens: kernels near their calls' cost
REPEATS = 30


def _median(fn: Callable[[], None], repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _phases(first: Callable[[], object], rest: list[Callable[[object], object]], repeats: int) -> list[float]:
    """Median seconds of each phase of a call made of ``first`` then each of ``rest`` (each fed
    the previous one's result), each phase timed on its own within the same call."""
    spans: list[list[float]] = [[] for _ in range(1 + len(rest))]
    for r in range(repeats + 3):
        t = time.perf_counter()
        out = first()
        marks = [time.perf_counter()]
        for fn in rest:
            out = fn(out)
            marks.append(time.perf_counter())
        if r >= 3:  # (three warm-up calls)
            for i, (a, b) in enumerate(zip([t, *marks], marks)):
                spans[i].append(b - a)
    return [statistics.median(x) for x in spans]


def measure_block(family: str, model_cfg: Mapping, layers: int, seq_len: int = TOKENS, repeats: int = REPEATS) -> dict:
    """Seconds of F, B, I and W of one block of ``family`` (``model_cfg``: its composed model
    config, of ``layers`` >= 3 blocks) as a middle stage, one microbatch of ``seq_len`` tokens,
    on the CPU."""
    if layers < 3:
        raise ValueError(f"{model_cfg.get('name', family)}: {layers} layers; a middle stage of one block needs 3")
    adapter = FAMILIES[family].load_adapter()(model_cfg, [1, 1, layers - 2], 1, seq_len, 0, torch.device("cpu"))
    stage = adapter.build_stage(1)
    shape, dtype = adapter.message_spec(0, 1)
    x = torch.randn(*shape, dtype=dtype, requires_grad=True)
    params = [p for p in stage.parameters() if p.requires_grad]
    nodes = accumulators(params)
    grad = torch.randn_like(stage(x))
    # the executor's forward counts what autograd saves (a hook per saved tensor, here
    # and in the backward that unpacks it): part of every action's host time
    meter = SavedBytes({t.untyped_storage().data_ptr() for t in [*stage.parameters(), *stage.buffers()]})

    def forward():
        with torch.no_grad():
            stage(x)

    def fwd():
        with meter.hooks():
            return stage(x)

    def backward(out):
        torch.autograd.backward(out, grad)

    def i_only(out):
        return backward_input(out, grad, [x], params, nodes, keep=meter.keep)[1]

    def w_only(pending):
        backward_weight(pending, params)

    f, b = _phases(fwd, [backward], repeats)
    _, i, w = _phases(fwd, [i_only, w_only], repeats)
    x.grad = None
    for p in params:
        p.grad = None
    return {"family": family, "model": str(model_cfg.get("name", family)), "tokens": seq_len,
            "F_s": f, "B_s": b, "I_s": i, "W_s": w, "no_grad_F_s": _median(forward, repeats)}
