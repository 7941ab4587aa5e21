"""What one microbatch's backward holds over time on one stage: B against the zero-bubble I.

For a stage of a model (default: gpt_tiny's last stage, 2 of its 4 layers, the LM head
and the loss; 4 sequences of 128 tokens, fp32) this runs one forward and then either B
(``autograd.backward``) or I (:func:`pipeflow.runtime.backward.backward_input`) under
torch's memory profiler (``runtime.memory=profile``'s analysis) and prints, in MiB:

- what the forward saved (the saved-bytes meter) and what I leaves for W (its residual);
- the peak during the forward and the backward, split by category.

The model beside it (``pipeflow/planning/cost.py``): the stage's activations plus B's
workspace (``workspace_bytes``) or I's (``input_workspace_bytes``). An I holds more than
B: it keeps each product's output gradient as it passes the layers above while the
layers below still hold their saved tensors, so its level bulges above both its start
and its end; ``--all`` compares every family and recomputation on a last stage and a
middle one (the middle stage's loss here, a mean of squares, saves the stage output on
top: a quarter MiB over the model at gpt_tiny's size). Byte counts: the same on every run.

    .venv/bin/python -m benchmarks.bench_split_memory [--model llama_tiny|bert_tiny] [--stages 4 --stage 1]
    .venv/bin/python -m benchmarks.bench_split_memory --recompute full
    .venv/bin/python -m benchmarks.bench_split_memory --all
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from pipeflow.config import compose, resolve_model  # noqa: E402
from pipeflow.families import family_of  # noqa: E402
from pipeflow.planning.cost import AnalyticCost, uniform_layers  # noqa: E402
from pipeflow.planning.transformer import TransformerSpec  # noqa: E402
from pipeflow.runtime.backward import backward_input, backward_weight  # noqa: E402
from pipeflow.runtime.saved_bytes import SavedBytes  # noqa: E402
from pipeflow.runtime.memory_profile import profile_step  # noqa: E402

MIB = 2**20


def measure(model: str = "gpt_tiny", stage: int = 1, microbatch_size: int = 4, stages: int = 2,
            recompute: str = "none") -> tuple[list[dict], dict]:
    """One row per backward kind (B, I): saved, residual and the profiled peak's split;
    and the model's activation, residual and backward workspaces for the stage (of
    ``stages`` even ones). The stage is built by the family's runtime adapter, as
    bench_split builds it."""
    torch.manual_seed(0)
    composed = compose("train", [f"model={model}", f"pipeline.microbatch_size={microbatch_size}",
                                 f"model.recompute={recompute}"])
    resolve_model(composed)  # a Hugging Face config's shape into model.n_layer, n_embd ...
    cfg = OmegaConf.to_container(composed.model, resolve=True)
    layers = uniform_layers(cfg["n_layer"], stages)
    adapter = family_of(cfg).load_adapter()(cfg, layers, microbatch_size, cfg["seq_len"], 0, torch.device("cpu"))
    st = adapter.build_stage(stage)
    last = stage == stages - 1
    params = [p for p in st.parameters() if p.requires_grad]
    b, T, H = microbatch_size, cfg["seq_len"], cfg["n_embd"]
    x0 = torch.randn(b, T, H) if stage > 0 else torch.randint(0, cfg["vocab_size"], (b, T))
    target = torch.randint(0, cfg["vocab_size"], (b, T))
    rows = []
    for kind in ("B", "I", "B", "I"):  # the first of each warms the allocator's caches
        meter = SavedBytes({p.untyped_storage().data_ptr() for p in params})
        with profile_step(torch.device("cpu")) as prof:
            x = x0.clone().requires_grad_() if stage > 0 else x0.clone()
            with meter.hooks():
                out = st(x)
            loss = (torch.nn.functional.cross_entropy(out.flatten(0, 1), target.flatten()) if last
                    else out.float().pow(2).mean())
            del out
            saved = meter.current
            if kind == "I":
                g, pending = backward_input(loss, None, [x], params, keep=meter.keep)
                del loss, g
                residual = meter.current
                backward_weight(pending, params)
                del pending
            else:
                loss.backward()
                del loss
                residual = 0
            del x
        # the parameters' gradients stay (accumulated, untagged): as in a step after its
        # first backward, they exist before each backward and are not part of its peak
        rows.append({"kind": kind, "saved": saved, "residual": residual, "peak": prof.peak_bytes,
                     "at_peak": prof.at_peak})
    cost = AnalyticCost(TransformerSpec.from_config(composed.model), stages, microbatch_size=b, dtype_bytes=4,
                        layers_per_stage=layers)
    model_row = {"activation": cost.activation_bytes(stage, 0), "residual": cost.weight_residual_bytes(stage, 0),
                 "workspace": cost.workspace_bytes(stage, 0), "input_workspace": cost.input_workspace_bytes(stage, 0)}
    return rows[2:], model_row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt_tiny")
    ap.add_argument("--stage", type=int, default=None, help="default: the last")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--recompute", default="none", choices=("none", "selective", "full"))
    ap.add_argument("--microbatch-size", type=int, default=4)
    ap.add_argument("--all", action="store_true",
                    help="every family and recomputation, on the last of 2 stages and the second of 4: "
                         "measured against modelled peaks only")
    args = ap.parse_args()
    if args.all:
        print("| model | recompute | stage | B measured | B model | ratio | I measured | I model | ratio |")
        print("|---|---|---|---|---|---|---|---|---|")
        for model in ("gpt_tiny", "llama_tiny", "bert_tiny"):
            for recompute in ("none", "selective", "full"):
                for stage, stages in ((1, 2), (1, 4)):
                    rows, m = measure(model, stage, args.microbatch_size, stages, recompute)
                    got = {r["kind"]: r["peak"] for r in rows}
                    want = {"B": m["activation"] + m["workspace"], "I": m["activation"] + m["input_workspace"]}
                    cells = " | ".join(f"{got[k] / MIB:.2f} | {want[k] / MIB:.2f} | {want[k] / got[k]:.3f}"
                                       for k in ("B", "I"))
                    print(f"| {model} | {recompute} | {stage} of {stages} | {cells} |", flush=True)
        return
    stage = args.stages - 1 if args.stage is None else args.stage
    rows, model = measure(args.model, stage, args.microbatch_size, args.stages, args.recompute)
    print(f"{args.model}, stage {stage} of {args.stages}, {args.microbatch_size} sequences, fp32, "
          f"recompute {args.recompute} (MiB)")
    print(f"model: activations {model['activation'] / MIB:.2f}, residual {model['residual'] / MIB:.2f}, "
          f"backward workspace: B {model['workspace'] / MIB:.2f}, I {model['input_workspace'] / MIB:.2f}")
    print("| backward | saved | left for W | peak | at the peak | modelled peak |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        split = ", ".join(f"{k} {v / MIB:.2f}" for k, v in r["at_peak"].items() if v)
        ws = model["input_workspace"] if r["kind"] == "I" else model["workspace"]
        print(f"| {r['kind']} | {r['saved'] / MIB:.2f} | {r['residual'] / MIB:.2f} | {r['peak'] / MIB:.2f} | {split} "
              f"| {(model['activation'] + ws) / MIB:.2f} |")


if __name__ == "__main__":
    main()
