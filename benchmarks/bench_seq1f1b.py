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
- per-GPU cost: :class:`TensorParallelCost`, the analytic cost of a stage divided by t
  (compute, messages, activations and model state): Megatron's tensor + sequence
  parallelism splits every matmul and every saved tensor t ways. The TP all-gathers
  and reduce-scatters are not timed (they are folded into the efficiency, 0.5 of the
  A100's 312 TFLOP/s as conf/cost/analytic.yaml). As in the paper's runs: flash
  attention (no seq x seq scores are kept), no dropout, no recomputation, rotary
  positions (no position table), untied output layer, bf16 with mixed-precision Adam
  (18 bytes per parameter of model state).
- topology: ``cluster`` with one device per node (p nodes, 25 GB/s InfiniBand per GPU;
  each of the t GPUs of a stage sends its 1/t slice of the activation).
- memory per GPU = simulated peak activations + weights, gradients and optimizer state,
  the largest over the pipeline's devices; a configuration over 80 GB (80e9 bytes;
  the A100 has 80 GiB, the rest left to the CUDA context, NCCL and the allocator's
  fragmentation) is marked OOM, as it would fail to run.
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

from pipeflow.planning.cost import AnalyticCost  # noqa: E402
from pipeflow.planning.seqsplit import segment_flops, split_sequence  # noqa: E402
from pipeflow.planning.transformer import TransformerSpec, layer_params  # noqa: E402
from pipeflow.schedules.registry import build_schedule  # noqa: E402
from pipeflow.sim.engine import simulate  # noqa: E402
from pipeflow.topology import get_topology  # noqa: E402

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


class TensorParallelCost(AnalyticCost):
    """The analytic cost of one pipeline stage run by ``tp`` GPUs with Megatron's tensor
    and sequence parallelism, per GPU: FLOPs, messages, saved activations and model
    state all divided by ``tp``.

    Saved activations per layer and token, flash attention and no dropout: the inputs
    of the two LayerNorms, of the QKV, output-projection and two FFN matmuls, Q, K, V
    and the GeLU input, (8H + 2Fw) * 2 bytes (Korthikanti et al. without the dropout
    masks and the seq x seq attention scores); with sequence segments also each
    segment's K/V gradient, accumulated until its own backward. The last stage keeps
    the final LayerNorm and head inputs and the fp32 logits. Parameters: rotary
    positions (no position table) and an output layer of its own (untied).
    """

    name = "analytic_tp"

    def __init__(self, spec: TransformerSpec, num_stages: int, tp: int, segment_lengths=None, **kw) -> None:
        self.tp = tp
        super().__init__(spec, num_stages, segment_lengths=segment_lengths, **kw)
        H, Fw, V, dt = spec.n_embd, spec.ffn_width, spec.vocab_size, self.dtype_bytes
        last = num_stages - 1
        self._activation = []
        for s, n in enumerate(self.layers_per_stage):
            row = []
            for x in self.segment_lengths:
                a = n * x * (8 * H + 2 * Fw) * dt
                if s == last:
                    a += 2 * x * H * dt + 4 * x * V
                row.append(a / tp)
            self._activation.append(row)

    def stage_params(self, stage: int) -> int:
        spec = self.spec
        n = self.layers_per_stage[stage] * layer_params(spec)
        if stage == 0:
            n += spec.vocab_size * spec.n_embd
        if stage == self.num_stages - 1:
            n += spec.vocab_size * spec.n_embd + 2 * spec.n_embd
        return n

    def compute_time(self, kind, stage, segment, device):
        return super().compute_time(kind, stage, segment, device) / self.tp

    def message_bytes(self, src_stage, dst_stage, segment):
        return super().message_bytes(src_stage, dst_stage, segment) / self.tp

    def weight_residual_bytes(self, stage, segment):
        return super().weight_residual_bytes(stage, segment) / self.tp

    def kv_gradient_bytes(self, stage, segment):
        return super().kv_gradient_bytes(stage, segment) / self.tp

    def param_bytes(self, stage):
        return super().param_bytes(stage) / self.tp

    def model_state_bytes(self, stage):
        return super().model_state_bytes(stage) / self.tp


def run(label: str, seq: int, segments: int = 1) -> dict:
    """Tokens/s and per-GPU memory (GB, the largest device) of one schedule at one length."""
    name, v, split, _ = SCHEDULES[label]
    spec = spec_for(seq)
    lengths = split_sequence(split, seq, segments, spec) if split else None
    opts = {"split": split, "segments": segments} if split else {"virtual_stages": v}
    sched = build_schedule(name, STAGES, MICROBATCHES, **opts)
    cost = TensorParallelCost(spec, sched.num_stages, TP, segment_lengths=lengths, efficiency=EFFICIENCY)
    topo = get_topology("cluster", STAGES, nodes=STAGES, gpus_per_node=1)
    r = simulate(sched, cost, topo, record=False)
    mem = [(d.peak_activation_bytes + d.weight_bytes + d.optimizer_bytes) / 1e9 for d in r.per_device]
    act = [d.peak_activation_bytes / 1e9 for d in r.per_device]
    return {
        "tok": MICROBATCHES * seq / r.makespan,
        "mem": max(mem),
        "act": act[mem.index(max(mem))],
        "oom": max(mem) > LIMIT_GB,
        "bubble": r.bubble_ratio,
        "segments": segments,
        "lengths": lengths,
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
        f"flash attention, sequence parallel, no recomputation; OOM above {LIMIT_GB:.0f} GB per GPU\n"
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
