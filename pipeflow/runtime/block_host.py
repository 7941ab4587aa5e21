"""The host's own time per transformer block: what a device profile's operators leave out.

An operator sweep times each kernel with its call, but a block's forward is more than its
kernels: the model's Python (transformers' attention interface, the reshapes, views and
transposes), the dispatcher's calls that launch nothing, and in the backward the autograd
engine's walk over every node. On one CPU thread that time adds to the kernels' (a GPU
overlaps it with them). Measured here with the runtime's own code, one block of a family
as a middle stage at a size where the kernels cost little more than their calls (one
microbatch of ``TOKENS`` tokens): F, B, and the zero-bubble split's I and W
(:mod:`pipeflow.runtime.backward`), under the executor's count of saved bytes. gpt_tiny's blocks took 0.33 ms forward and 0.40 ms
backward a block on a 2-core EPYC host: at gpt_tiny's size (512 tokens a microbatch) a
fifth of F, which the priced operators alone missed.

The device profile (:mod:`pipeflow.planning.device_profile`) takes from each row the
kernels' launches that the operators already price (``kernels``: the operator list's
count for the same block) and adds the rest per block of that family.
"""

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
    """Median seconds of each phase of a call made of ``first`` then each of ``rest`` in
    turn (each fed the previous one's result), every phase timed on its own within the
    same call: a backward's time is not a difference of two noisy medians."""
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
    """Seconds of F, B, I and W of one block of ``family`` (``model_cfg``: a composed model
    config of it, of ``layers`` blocks, three or more) as a middle stage of one block, one microbatch of ``seq_len``
    tokens, on the CPU."""
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
