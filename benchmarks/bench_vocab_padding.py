"""The head padded past the vocabulary (``model.vocab_multiple``) against unpadded, side by
side in one run.

A GPT's last stage ends in the head's product ``[tokens, n_embd] x [n_embd, V]`` and the
loss over its logits; with the preset's ``model.vocab_multiple=64`` the product runs at
the padded width (GPT-2's 50,257 words: 50,304) and the loss reads the words' logits.
Each repeat times the forward and backward of both (pipeflow's chunked cross-entropy, the
head's weight gradient and its input's) at the two widths, alternating which goes first;
reported are the medians, their ratio padded/unpadded, each repeat's own ratio (the
spread), and whether the two gave the same loss (they must: the padding's logits are never
read). Beside them, what the shipped H200 profile (``topology.device=h200``) prices the
head's three products at for the same tokens at bf16: the time model's view of a GPU.

    .venv/bin/python -m benchmarks.bench_vocab_padding
    .venv/bin/python -m benchmarks.bench_vocab_padding --model gpt_medium --tokens 2048 --repeats 9

Prints a table; it reports, it does not fail.
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
import torch.nn.functional as F  # noqa: E402

from pipeflow.config import compose  # noqa: E402
from pipeflow.models.loss import cross_entropy_sum  # noqa: E402
from pipeflow.planning.transformer import padded_vocab  # noqa: E402


def _step(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab: int) -> tuple[float, float]:
    """(seconds, loss) of the head's product and the loss, forward and backward."""
    x = x.detach().requires_grad_(True)
    weight.grad = None
    t = time.perf_counter()
    loss = cross_entropy_sum(F.linear(x, weight), targets, vocab=vocab)
    loss.backward()
    return time.perf_counter() - t, float(loss.detach())


def measure(width: int, vocab: int, multiple: int, tokens: int, repeats: int, seed: int = 0) -> dict:
    """Both widths, alternating, ``repeats`` times (see the module's docstring)."""
    gen = torch.Generator().manual_seed(seed)
    rows = padded_vocab(vocab, multiple)
    x = torch.randn(tokens, width, generator=gen)
    words = torch.randn(vocab, width, generator=gen) * 0.02
    weights = {vocab: words.clone().requires_grad_(True),
               rows: torch.cat([words, torch.zeros(rows - vocab, width)]).requires_grad_(True)}
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    times: dict[int, list[float]] = {vocab: [], rows: []}
    losses: dict[int, list[float]] = {vocab: [], rows: []}
    for r in range(repeats + 1):  # the first round warms the allocator and the kernels up
        for v in ((vocab, rows) if r % 2 == 0 else (rows, vocab)):
            seconds, loss = _step(x, weights[v], targets, vocab)
            if r:
                times[v].append(seconds)
                losses[v].append(loss)
    med = {v: statistics.median(t) for v, t in times.items()}
    return {"width": width, "vocab": vocab, "rows": rows, "tokens": tokens, "repeats": repeats, "median": med,
            "ratio": med[rows] / med[vocab], "run_ratios": [p / u for p, u in zip(times[rows], times[vocab])],
            "loss": losses[vocab][0], "loss_max_rel_diff": max(abs(a - b) / abs(b) for a, b in
                                                               zip(losses[rows], losses[vocab])),
            "words_grad_equal": bool(torch.allclose(weights[rows].grad[:vocab], weights[vocab].grad,
                                                    rtol=1e-4, atol=1e-6)),
            "padding_grad_zero": not weights[rows].grad[vocab:].any()}


def h200_prices(width: int, vocab: int, rows: int, tokens: int) -> dict[int, float]:
    """The shipped H200 profile's seconds for the head's forward, input-gradient and
    weight-gradient products at bf16, at each width."""
    from pipeflow.planning.from_sweep import load_profile
    from pipeflow.planning.operators import Product
    from pipeflow.topology.presets import PROFILES

    prof = load_profile(PROFILES / "h200.json")
    return {v: sum(prof.time(Product(phase, tokens, width, v, 2)) for phase in ("fwd", "dgrad", "wgrad"))
            for v in (vocab, rows)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt_small", help="a GPT or BERT preset (its width, vocabulary and padding)")
    ap.add_argument("--tokens", type=int, default=1024, help="tokens through the head (a microbatch's)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--multiple", type=int, default=None, help="the padding's multiple (default: the preset's, or 64)")
    args = ap.parse_args(argv)
    model = compose("train", [f"model={args.model}"]).model
    preset = model.get("vocab_multiple") or 1
    multiple = args.multiple or (preset if preset > 1 else 64)
    r = measure(model.n_embd, model.vocab_size, multiple, args.tokens, args.repeats)
    v, p = r["vocab"], r["rows"]
    print(f"{args.model}: the head [{args.tokens} tokens x {r['width']}] x [{r['width']} x V] and the chunked loss, "
          f"forward + backward, fp32 on this CPU ({torch.get_num_threads()} threads), {args.repeats} repeats "
          f"alternating")
    print(f"  V = {v:>6} (unpadded)            {r['median'][v] * 1e3:8.1f} ms")
    print(f"  V = {p:>6} (padded to {multiple:>3})       {r['median'][p] * 1e3:8.1f} ms")
    print(f"padded / unpadded: {r['ratio']:.3f}  (repeats: {' '.join(f'{x:.3f}' for x in r['run_ratios'])})")
    print(f"the same loss: largest relative difference {r['loss_max_rel_diff']:.1e}; the words' gradient the same: "
          f"{r['words_grad_equal']}; the padding's zero: {r['padding_grad_zero']}")
    h200 = h200_prices(r["width"], v, p, args.tokens)
    print(f"the H200 profile's bf16 head products (fwd + dgrad + wgrad) for {args.tokens} tokens: "
          f"{h200[v] * 1e6:.0f} us at {v}, {h200[p] * 1e6:.0f} us at {p} (padded / unpadded {h200[p] / h200[v]:.3f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
