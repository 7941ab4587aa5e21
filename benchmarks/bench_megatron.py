"""Megatron-LM's weak-scaling table (SC'21, Table 1), simulated: TFLOP/s per GPU.

Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM" (SC'21), Table 1, trains GPT models of 1.7B to 310.1B parameters on DGX
A100-80GB nodes (8 GPUs on NVSwitch, 8 x 200 Gb/s HDR InfiniBand per node) at sequence
length 2048, vocabulary 51,200, mixed precision and full activation recomputation, and
reports the model FLOP/s each GPU achieved. This benchmark simulates each row:

- model: GPT-2's block at the row's layers, hidden size and heads, MLP width 4 x hidden,
  ``model.recompute=full``, ``precision=bf16`` (conf/model/gpt_7b.yaml reshaped);
- parallelism: the row's tensor (TP) and pipeline (PP) degrees, data parallelism
  GPUs / (TP x PP); microbatch size from the authors' launch script for the table
  (Megatron-LM's examples/sc21/run_table_1.sh: 16, 16, 16, 8, 4, 2, 2, 1), so each
  pipeline runs global batch / (DP x microbatch size) microbatches;
- schedule: 1F1B (``interleaved=True``: interleaved 1F1B with the launch script's
  virtual stages for the three largest rows, where the authors interleaved);
- topology: ``cluster`` of GPUs / 8 nodes, A100-80GB, the preset's NVLink (300 GB/s)
  and one 25 GB/s NIC per GPU, which is the paper's hardware;
- cost: ``cost=analytic`` as configured (0.5 of the A100's 312 TFLOP/s).

TFLOP/s per GPU is the paper's own count, 96 B s l h^2 (1 + s/(6h) + V/(16 l h)) model
FLOPs per iteration with recomputation, over (simulated step time x GPUs). pipeflow's
cost counts a causal model's attention scores at half, where the paper's count takes them
whole: at 2048 tokens that is 6 % of the paper's count in the 1.7B row, 1 % in the 310.1B
row, time the simulated step does not spend.

    .venv/bin/python -m benchmarks.bench_megatron [--sizes 1.7,18.4,310.1] [--interleaved]

It reports, it does not fail. The 1,920-GPU row takes about 20 s, most of it building the
cluster's topology (every pair of GPUs' route).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeflow.config import compose, prepare_simulation  # noqa: E402
from pipeflow.sim.device_memory import device_memory, library_workspace  # noqa: E402
from pipeflow.sim.engine import simulate  # noqa: E402

PAPER = "Narayanan et al., Megatron-LM (SC'21), Table 1"
SEQ = 2048
VOCAB = 51200
GPUS_PER_NODE = 8
LIMIT_GB = 80.0  # as bench_seq1f1b: a device whose walked peak is above this is out of memory
BAND = (0.8, 1.2)  # simulated / published TFLOP/s per GPU that counts as reproduced


@dataclass(frozen=True)
class Size:
    """One row of Table 1 and the launch script's microbatch size and virtual stages."""

    params: str  # billions, as the paper writes it
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int  # global batch, sequences
    published: float  # achieved TFLOP/s per GPU
    microbatch: int
    virtual: int = 1  # interleaved stages per device in the launch script (1: plain 1F1B)

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    @property
    def microbatches(self) -> int:
        return self.batch // (self.dp * self.microbatch)


SIZES: dict[str, Size] = {s.params: s for s in (
    Size("1.7", 24, 2304, 24, 1, 1, 32, 512, 137, 16),
    Size("3.6", 32, 3072, 30, 2, 1, 64, 512, 138, 16),
    Size("7.5", 32, 4096, 36, 4, 1, 128, 512, 142, 16),
    Size("18.4", 48, 6144, 40, 8, 1, 256, 1024, 135, 8),
    Size("39.1", 64, 8192, 48, 8, 2, 512, 1536, 138, 4),
    Size("76.1", 80, 10240, 60, 8, 4, 1024, 1792, 140, 2, virtual=3),
    Size("145.6", 96, 12288, 80, 8, 8, 1536, 2304, 148, 2, virtual=2),
    Size("310.1", 128, 16384, 96, 8, 16, 1920, 2160, 155, 1, virtual=2),
)}
QUICK = ("1.7", "18.4", "310.1")


def model_flops(size: Size) -> float:
    """The paper's model FLOPs of one iteration with full recomputation (its equation 3)."""
    b, s, l, h = size.batch, SEQ, size.layers, size.hidden
    return 96 * b * s * l * h * h * (1 + s / (6 * h) + VOCAB / (16 * l * h))


def overrides(size: Size, interleaved: bool = False) -> list[str]:
    """The pipeflow-simulate overrides of one row."""
    out = ["model=gpt_7b", f"model.name=gpt_{size.params}b", f"model.n_layer={size.layers}",
           f"model.n_head={size.heads}", f"model.n_embd={size.hidden}", "model.n_inner=null",
           f"model.vocab_size={VOCAB}", f"model.seq_len={SEQ}", f"model.n_positions={SEQ}", "model.recompute=full",
           "precision=bf16", "topology=cluster", f"topology.nodes={size.gpus // GPUS_PER_NODE}",
           f"topology.gpus_per_node={GPUS_PER_NODE}", "topology.device=a100-80g",
           f"pipeline.stages={size.pp}", f"pipeline.tensor_parallel={size.tp}",
           f"pipeline.data_parallel={size.dp}", f"pipeline.microbatch_size={size.microbatch}",
           f"pipeline.microbatches={size.microbatches}", "draw=false"]
    if interleaved and size.virtual > 1:
        return out + ["schedule=interleaved_1f1b", f"pipeline.virtual_stages={size.virtual}"]
    return out + ["schedule=1f1b"]


def measure(params: str, interleaved: bool = False) -> dict:
    """Simulate one row: its step time, TFLOP/s per GPU against the published figure, and
    the largest device's walked memory; ``seconds`` is the wall time of composing,
    simulating and walking the memory."""
    size = SIZES[params]
    ov = overrides(size, interleaved)
    t0 = time.perf_counter()
    inputs = prepare_simulation(compose("simulate", ov))
    sched, cost, topo = inputs.schedule, inputs.cost, inputs.topology
    result = simulate(sched, cost, topo, record=False)
    walked = device_memory(sched, cost, result.per_device, library_workspace(topo, sched.num_devices))
    seconds = time.perf_counter() - t0
    tflops = model_flops(size) / (result.makespan * size.gpus) / 1e12
    memory = max(w["peak_bytes"] for w in walked) / 1e9
    return {
        "size": params,
        "config": {"tp": size.tp, "pp": size.pp, "dp": size.dp, "gpus": size.gpus, "batch": size.batch,
                   "microbatch_size": size.microbatch, "microbatches": size.microbatches,
                   "schedule": sched.name, "virtual_stages": size.virtual if interleaved else 1},
        "overrides": ov,
        "step_s": result.makespan,
        "tflops": tflops,
        "published": size.published,
        "ratio": tflops / size.published,
        "bubble": result.bubble_ratio,
        "memory_gb": memory,
        "oom": memory > LIMIT_GB,
        "seconds": seconds,
    }


def results(sizes: tuple[str, ...] = tuple(SIZES), interleaved: bool = False) -> list[dict]:
    """:func:`measure` of each size, in the order given."""
    return [measure(s, interleaved) for s in sizes]


def in_band(ratio: float) -> bool:
    return BAND[0] <= ratio <= BAND[1]


def table(rows: list[dict]) -> str:
    """The rows as a plain-text table."""
    head = (f"{'params':>7} {'TP':>2} {'PP':>3} {'DP':>3} {'mbs':>3} {'m':>4} {'schedule':>16} {'step s':>8} "
            f"{'TFLOP/s':>8} {'paper':>6} {'ratio':>6} {'band':>5} {'GB':>5} {'sim s':>6}")
    lines = [head]
    for r in rows:
        c = r["config"]
        lines.append(
            f"{r['size'] + 'B':>7} {c['tp']:>2} {c['pp']:>3} {c['dp']:>3} {c['microbatch_size']:>3} "
            f"{c['microbatches']:>4} {c['schedule']:>16} {r['step_s']:>8.3f} {r['tflops']:>8.1f} "
            f"{r['published']:>6.0f} {r['ratio']:>6.3f} {'in' if in_band(r['ratio']) else 'OUT':>5} "
            f"{r['memory_gb']:>5.1f}{'!' if r['oom'] else ' '}{r['seconds']:>5.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default=",".join(SIZES),
                    help=f"comma-separated billions of parameters, of {', '.join(SIZES)} (default: all)")
    ap.add_argument("--interleaved", action="store_true",
                    help="interleaved 1F1B with the launch script's virtual stages where it had some")
    args = ap.parse_args(argv)
    sizes = tuple(s.strip().removesuffix("B") for s in args.sizes.split(",") if s.strip())
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        ap.error(f"--sizes: unknown {', '.join(unknown)}; allowed: {', '.join(SIZES)}")
    print(f"{PAPER}: simulated TFLOP/s per GPU against published (pass band {BAND[0]}-{BAND[1]}; "
          f"GB: the largest device's peak, ! above {LIMIT_GB:.0f})")
    print(table(results(sizes, args.interleaved)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
