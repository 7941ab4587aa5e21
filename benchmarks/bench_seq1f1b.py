"""Seq1F1B against 1F1B and interleaved 1F1B on long sequences, memory-aware, simulated.

The Seq1F1B paper (ALGORITHMS.md, "Seq1F1B") reports tokens/s of a 7B GPT on 32 A100s
at sequence lengths 32k, 64k and 128k with m = 8 microbatches of one sequence; at 128k
1F1B and interleaved 1F1B run out of memory and only Seq1F1B trains. This benchmark
predicts the same rows with pipeflow's simulator:

- model: 32 layers, hidden 4096, 32 heads, FFN 16384, vocabulary 50304
  (conf/model/gpt_7b.yaml) at seq 32768, 65536, 131072; microbatch 1, m = 8.
- parallelism (assumption): the 32 GPUs are p = 4 pipeline stages x t = 8-way tensor
  parallelism, data parallelism 1: one pipeline stage per DGX A100 node (TP inside a
  node over NVSwitch, PP between nodes over InfiniBand), the layout of the authors'
  Megatron-LM scripts (TP 8 inside a node, PP across nodes). p = 4 is also what the
  published m = 16 / m = 8 1F1B speed-up at 32k (55333 / 48189 = 1.148) points to:
  the 1F1B bubble gives (16/19) / (8/11) = 1.158 at p = 4 and 1.30 at p = 8.
- per-GPU cost: the product's own tensor-parallel pricing (docs/simulation.md, "Tensor
  parallelism"): the run is composed as ``pipeflow-simulate model=gpt_7b
  topology=cluster topology.nodes=4 pipeline.stages=4 pipeline.tensor_parallel=8
  pipeline.sequence_parallel=true`` would compose it, so the analytic cost prices one
  rank of each stage's tensor group (heads, MLP width and vocabulary split 8 ways, the
  norms and the stream on s/8 tokens), and each action waits for its group's
  all-gathers and reduce-scatters on the node's NVSwitch. 0.5 of the A100's 312
  TFLOP/s (conf/cost/analytic.yaml), bf16 with pipeflow's mixed precision (fp32
  weights, gradients and AdamW moments, a bf16 cast of each matrix: 18 bytes per
  parameter), fused attention (no seq x seq score is kept), no dropout, no
  recomputation. The model is conf/model/gpt_7b.yaml: GPT-2's shape (a learned
  position table of seq rows, which each rank keeps whole, and a tied head), where
  the paper's Megatron model had rotary positions and an untied head.
- topology: ``cluster`` of p DGX A100 nodes (NVSwitch inside, 25 GB/s InfiniBand per
  GPU); a stage's 8 GPUs are one node, and each sends its 1/8 of the activation to its
  match on the next node.
- memory per GPU = the simulator's walk of every category (model state, activations,
  outputs, buffers, temporaries, the math libraries' workspace), the largest over the
  pipeline's devices; a configuration over 80 GB (80e9 bytes; the A100 has 80 GiB, the
  rest left to the CUDA context, NCCL and the allocator's fragmentation) is marked OOM,
  as it would fail to run.
- sequence parallelism cuts each segment into 8 slices, so a segment must be a
  multiple of 8 tokens: the product's split (``schedule.split``, with
  ``pipeline.sequence_parallel``) rounds the compute split's lengths (the paper's,
  ``lengths`` in the rows) to multiples of 8 for the run (``simulated_lengths``), the
  first s - 1 to the nearest, the last the rest
  (:func:`pipeflow.planning.seqsplit.granular`).
- schedules: 1f1b, interleaved_1f1b (v = 2), seq1f1b with split uniform and compute at
  s = 4 (the paper's), or the smallest s in 4, 8, 16 that fits in memory.

Throughput = m * seq / makespan of one iteration (one flush), for the whole 32-GPU job.

    .venv/bin/python -m benchmarks.bench_seq1f1b

It reports, it does not fail.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeflow.config import compose, prepare_simulation  # noqa: E402
from pipeflow.planning.seqsplit import segment_flops, split_sequence  # noqa: E402
from pipeflow.planning.transformer import TransformerSpec  # noqa: E402
from pipeflow.sim.engine import simulate  # noqa: E402
from pipeflow.sim.device_memory import device_memory, library_workspace  # noqa: E402

STAGES = 4  # pipeline depth p
TP = 8  # tensor-parallel GPUs per stage
MICROBATCHES = 8
EFFICIENCY = 0.5
LIMIT_GB = 80.0
SEQS = (32768, 65536, 131072)
SEGMENTS = (4, 8, 16)  # the paper's s = 4 first; more only if 4 does not fit

# seq -> published tokens/s: 1F1B, 1F1B-I, Seq1F1B (None: out of memory)
PUBLISHED = {
    32768: (48189, 52964, 53485),
    65536: (37343, 41677, 43297),
    131072: (None, None, 30392),
}

# label -> (schedule, virtual stages, split or None, published column)
SCHEDULES = {
    "1f1b": ("1f1b", 1, None, 0),
    "interleaved_1f1b (v=2)": ("interleaved_1f1b", 2, None, 1),
    "seq1f1b uniform": ("seq1f1b", 1, "uniform", 2),
    "seq1f1b compute": ("seq1f1b", 1, "compute", 2),
}


def spec_for(seq: int) -> TransformerSpec:
    return TransformerSpec("gpt_7b", n_layer=32, n_head=32, n_embd=4096, vocab_size=50304, seq_len=seq, n_inner=16384)


def overrides(name: str, seq: int, virtual: int = 1, split: str | None = None, segments: int = 1) -> list[str]:
    """The pipeflow-simulate overrides of one row."""
    out = ["model=gpt_7b", f"model.seq_len={seq}", f"model.n_positions={seq}", f"schedule={name}",
           "topology=cluster", f"topology.nodes={STAGES}", f"topology.gpus_per_node={TP}",
           f"pipeline.stages={STAGES}", f"pipeline.microbatches={MICROBATCHES}", f"pipeline.tensor_parallel={TP}",
           "pipeline.sequence_parallel=true", f"cost.efficiency={EFFICIENCY}", "precision=bf16", "draw=false"]
    if split:  # (the product cuts each segment to a multiple of TP tokens: sequence parallelism)
        out += [f"schedule.split={split}", f"pipeline.segments={segments}"]
    elif virtual > 1:
        out.append(f"pipeline.virtual_stages={virtual}")
    return out


def run(label: str, seq: int, segments: int = 1) -> dict:
    """Tokens/s and per-GPU memory (GB, the largest device) of one schedule at one length."""
    name, v, split, _ = SCHEDULES[label]
    lengths = split_sequence(split, seq, segments, spec_for(seq)) if split else None
    inputs = prepare_simulation(compose("simulate", overrides(name, seq, v, split, segments)))
    used = inputs.segment_lengths if split else None
    sched, cost, topo = inputs.schedule, inputs.cost, inputs.topology
    r = simulate(sched, cost, topo, record=False)
    walked = device_memory(sched, cost, r.per_device, library_workspace(topo, sched.num_devices))
    mem = [m["peak_bytes"] / 1e9 for m in walked]
    worst = mem.index(max(mem))
    return {
        "tok": MICROBATCHES * seq / r.makespan,
        "mem": max(mem),
        "act": walked[worst]["at_peak"]["activations"] / 1e9,
        "oom": max(mem) > LIMIT_GB,
        "bubble": r.bubble_ratio,
        "segments": segments,
        "lengths": lengths,
        "simulated_lengths": used,
    }


def run_seq1f1b(label: str, seq: int) -> dict:
    """s = 4, or the smallest s of SEGMENTS that fits in memory (the last tried if none does)."""
    for s in SEGMENTS:
        out = run(label, seq, s)
        if not out["oom"]:
            break
    return out


def results() -> dict[int, dict[str, dict]]:
    """seq -> schedule label -> :func:`run`'s dict (seq1f1b labels via :func:`run_seq1f1b`)."""
    rows: dict[int, dict[str, dict]] = {}
    for seq in SEQS:
        rows[seq] = {}
        for label, (_, _, split, _) in SCHEDULES.items():
            rows[seq][label] = run_seq1f1b(label, seq) if split else run(label, seq)
    return rows


def _tok(r: dict) -> str:
    return f"OOM (sim {r['tok']:,.0f})" if r["oom"] else f"{r['tok']:,.0f}"


def _pub(x) -> str:
    return "OOM" if x is None else f"{x:,}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.parse_args(argv)
    t0 = time.perf_counter()
    print(
        f"7B GPT (32 layers, hidden 4096, 32 heads, vocab 50304) on {STAGES * TP} A100s: p={STAGES} pipeline "
        f"stages x t={TP} tensor parallel, DP 1; m={MICROBATCHES}, microbatch 1; efficiency {EFFICIENCY}; "
        f"flash attention, sequence parallel (priced by pipeline.tensor_parallel={TP}), no recomputation; "
        f"OOM above {LIMIT_GB:.0f} GB per GPU\n"
    )
    rows = results()

    head = ["seq", "schedule", "s", "tokens/s (pf)", "peak GB/GPU (pf)", "activations GB", "bubble (pf)",
            "tokens/s (pub)", "x 1F1B (pf)", "x 1F1B (pub)"]
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    for seq, res in rows.items():
        pub = PUBLISHED[seq]
        base = res["1f1b"]
        for label, r in res.items():
            col = SCHEDULES[label][3]
            ours = "n/a" if r["oom"] or base["oom"] else f"{r['tok'] / base['tok']:.3f}"
            theirs = "n/a" if pub[col] is None or pub[0] is None else f"{pub[col] / pub[0]:.3f}"
            cells = [str(seq), label, str(r["segments"]), _tok(r), f"{r['mem']:.1f}", f"{r['act']:.1f}",
                     f"{r['bubble']:.3f}", _pub(pub[col]), ours, theirs]
            print("| " + " | ".join(cells) + " |")

    print()
    for seq, res in rows.items():
        pub = PUBLISHED[seq]
        base = res["1f1b"]
        parts = []
        for label in ("seq1f1b uniform", "seq1f1b compute"):
            r = res[label]
            parts.append(f"{label.split()[1]} s={r['segments']} {r['tok'] / base['tok']:.3f}"
                         + (" (1F1B OOM)" if base["oom"] else ""))
        pub_ratio = f"{pub[2] / pub[0]:.3f}" if pub[0] else "n/a (1F1B OOM)"
        print(f"seq {seq}: seq1f1b / 1f1b pipeflow {', '.join(parts)}; published {pub_ratio}")
    for seq in SEQS:
        r = rows[seq]["seq1f1b compute"]
        flops = segment_flops(r["lengths"], spec_for(seq))
        print(f"seq {seq} compute split s={r['segments']}: {r['lengths']} tokens, FLOPs max/min "
              f"{max(flops) / min(flops):.4f}")
    print(f"\n{time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
