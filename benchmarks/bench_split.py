"""The zero-bubble split against the full backward, on one stage, in one process.

For gpt_tiny's last stage (2 of its 4 layers, the LM head and the loss; 4 sequences of
128 tokens, one thread) this times, in rounds of 8 microbatches each (the first
microbatch's gradient new, the others accumulated, as in a step), the variants
alternating round by round, medians:

- **B**: ``autograd.backward`` from the loss, what 1F1B runs;
- **I + W**: :func:`pipeflow.runtime.backward.backward_input` then ``backward_weight``,
  what ZB-H1 runs, with I freeing the graph as it goes (the runtime's way);
- **I + W, graph kept**: the same with ``free_graph=False``: the graph (every saved
  activation) kept whole until W, as the split did before.

and reports (I + W) / B for both. The acceptance of issue 14 asks <= 1.1 per stage.

    .venv/bin/python -m benchmarks.bench_split [--repeats 80]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from pipeflow.config import compose  # noqa: E402
from pipeflow.families import family_of  # noqa: E402
from pipeflow.runtime.backward import accumulators, backward_input, backward_weight  # noqa: E402

MICROBATCHES = 8  # per step, as in bench_fidelity


def measure(repeats: int = 80) -> dict:
    torch.set_num_threads(1)
    cfg = OmegaConf.to_container(compose("train", ["model=gpt_tiny"]).model, resolve=True)
    adapter = family_of(cfg).load_adapter()(cfg, [2, 2], 4, cfg["seq_len"], 0, torch.device("cpu"))
    module = adapter.build_stage(1)
    params = [p for p in module.parameters() if p.requires_grad]
    nodes = accumulators(params)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, cfg["seq_len"], cfg["n_embd"], generator=gen)
    target = torch.randint(0, cfg["vocab_size"], (4, cfg["seq_len"]), generator=gen)

    def forward():
        h = x.clone().requires_grad_(True)
        return h, torch.nn.functional.cross_entropy(module(h).flatten(0, 1), target.flatten())

    def full() -> float:
        _, loss = forward()
        t = time.perf_counter()
        torch.autograd.backward(loss)
        return time.perf_counter() - t

    def split(free: bool) -> float:
        h, loss = forward()
        t = time.perf_counter()
        _, pending = backward_input(loss, None, [h], params, nodes, free_graph=free)
        backward_weight(pending, params)
        return time.perf_counter() - t

    variants = {"B": full, "I+W": lambda: split(True), "I+W kept": lambda: split(False)}
    times: dict[str, list[float]] = {k: [] for k in variants}
    for rnd in range(repeats // MICROBATCHES + 1):
        for name, run in variants.items():
            # as in a step: the first microbatch's gradient is new, the others accumulate
            module.zero_grad(set_to_none=True)
            for _ in range(MICROBATCHES):
                t = run()
                if rnd:  # the first round warms up
                    times[name].append(t)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"ms": {k: v * 1e3 for k, v in med.items()}, "split_over_B": med["I+W"] / med["B"],
            "kept_over_B": med["I+W kept"] / med["B"], "repeats": repeats}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=80)
    res = measure(ap.parse_args(argv).repeats)
    ms = res["ms"]
    print(f"gpt_tiny last stage, 1 thread, {res['repeats']} microbatches per variant in alternating rounds of "
          f"{MICROBATCHES}, medians: B {ms['B']:.2f} ms, "
          f"I+W {ms['I+W']:.2f} ms, I+W with the graph kept {ms['I+W kept']:.2f} ms")
    print(f"(I + W) / B: {res['split_over_B']:.3f} (target <= 1.1); graph kept until W: {res['kept_over_B']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
