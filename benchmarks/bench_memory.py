"""Does the simulator predict what each rank allocates? Measured against simulated memory,
per device and by category, for the runtime's schedules, families and precisions.

Each case trains 2 steps (an asynchronous schedule 3: :func:`_steps`) on CPU ranks with
``runtime.memory=profile`` (every allocation of the last step, by what holds it:
:mod:`pipeflow.runtime.memory_profile`) and
simulates the same config (``pipeflow-simulate``, ``topology=local_cpu``, the same
precision); per device it prints the measured peak (the most bytes live at one
instant), the simulated peak (:mod:`pipeflow.sim.device_memory`), their ratio, the action
each peaks in, and the category where the two differ most (difference / measured peak)
at their peaks and in the action where the rank peaked (where the simulator peaks in
another action whose total is within its error of that one's, the two instants split
about the same bytes differently: both are shown):

- ``parameters``, ``weight_versions`` (an asynchronous policy's extra weight copies),
  ``optimizer_state`` (AdamW's moments), ``gradients`` (the ``.grad`` of each parameter);
- ``casts``: at 16 bits, the one cast of each weight a step's products share;
- ``activations``: what forwards keep for backwards (the Seq1F1B keys and values, which
  the profile names ``kv``, with them); ``residuals``: what a zero-bubble I keeps for W;
- ``outputs``: a stage's outputs kept for their backward and sends not yet proven
  arrived; ``inputs``: receive buffers; ``temporaries``: everything else (a backward's
  gradients on the way, the optimizer's buffers, a recomputed layer).

Byte counts do not depend on the machine's load: the table is the same on every run.
Run from the repository root (each case spawns its ranks, 5-15 s):

    .venv/bin/python -m benchmarks.bench_memory                 # the whole matrix
    .venv/bin/python -m benchmarks.bench_memory --quick         # one case per concern
    .venv/bin/python -m benchmarks.bench_memory --real          # real widths: hidden 768-1024, 2k-4k tokens
    .venv/bin/python -m benchmarks.bench_memory --only zb_h1 --json out.json
    .venv/bin/python -m benchmarks.bench_memory --sample 40   # drawn from the whole product
    .venv/bin/python -m benchmarks.bench_memory --product --only "cbm zb_h1,cbm zb_h2"   # every such case of it
    .venv/bin/python -m benchmarks.bench_memory --case "model=cbm_tiny schedule=zb_h1 pipeline.stages=2"
    .venv/bin/python -m benchmarks.bench_memory --device cuda --quick   # the ranks on the GPU
    .venv/bin/python -m benchmarks.bench_memory --device cuda --set "model.seq_len=2048 model.n_positions=2048"

With ``--device cuda`` each case's ranks compute on the GPU (``runtime.backend=gloo
runtime.device=cuda``: several ranks share one GPU, each with its own caching allocator,
and their messages pass through host memory), and the measured peak is each rank's
``torch.cuda.max_memory_allocated`` over the profiled step; the categories come from
the allocator's own history of the step (:mod:`pipeflow.runtime.memory_profile`).
``--one-stage`` runs each case as one stage instead (``pipeline.stages=1``: the whole
model in one process, its microbatches accumulated).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipeflow.config import compose, prepare_training
from pipeflow.runtime.launch import TrainJob, launch
from pipeflow.sim.device_memory import COMPARED as GROUPS
from pipeflow.simulate import run_simulation


SHAPE = ["pipeline.microbatches=8", "pipeline.microbatch_size=4"]
FAMILIES = {"gpt": ["model=gpt_tiny"], "llama": ["model=llama_tiny"], "bert": ["model=bert_tiny"]}
SCHEDULES = {
    "gpipe": ["schedule=gpipe"],
    "1f1b": ["schedule=1f1b"],
    "interleaved_1f1b": ["schedule=interleaved_1f1b", "pipeline.virtual_stages=2"],
    "zb_h1": ["schedule=zb_h1"],
    "zb_h2": ["schedule=zb_h2"],
    "zb_v": ["schedule=zb_v", "pipeline.virtual_stages=2"],
    "seq1f1b": ["schedule=seq1f1b", "pipeline.segments=4"],
    "1f1b x2 replicas": ["schedule=1f1b", "pipeline.data_parallel=2"],
    "pipedream": ["schedule=pipedream"],
    "pipedream_2bw": ["schedule=pipedream_2bw"],
}
CAUSAL_ONLY = {"seq1f1b"}
CBM_SCHEDULES = {"gpipe", "1f1b", "zb_h1", "zb_h2", "chimera"}  # and BAPP: what a branched model runs
MORE = {  # the runtime's other schedules
    "chimera": ["schedule=chimera"],
    "dualpipe_v": ["schedule=dualpipe_v", "pipeline.virtual_stages=2"],
    "interleaved_zb": ["schedule=interleaved_zb", "pipeline.virtual_stages=2"],
    "looped_bfs": ["schedule=looped_bfs", "pipeline.virtual_stages=2"],
    "seq1f1b_interleaved": ["schedule=seq1f1b_interleaved", "pipeline.virtual_stages=2", "pipeline.segments=4"],
    "amdp": ["schedule=amdp"],
    "planned": ["schedule=planned"],
}


def cases(quick: bool = False) -> list[tuple[str, list[str]]]:
    """(label, overrides) of the matrix: every schedule x family at fp32 on 2 ranks;
    bf16, selective and full recomputation for each family under 1F1B and ZB-H1; 4 ranks
    for 1F1B and ZB-H1; the other schedules (:data:`MORE`) on gpt, and the concurrent-branch
    model (cbm) under BAPP and 1F1B. ``quick``: one case per concern."""
    out = []
    for fam, f in FAMILIES.items():
        for name, s in SCHEDULES.items():
            if fam == "bert" and name in CAUSAL_ONLY:
                continue
            out.append((f"{fam} {name} fp32", [*f, *s, "pipeline.stages=2", "precision=fp32"]))
        for name in ("1f1b", "zb_h1"):
            s = SCHEDULES[name]
            out.append((f"{fam} {name} bf16", [*f, *s, "pipeline.stages=2", "precision=bf16"]))
            for mode in ("selective", "full"):
                out.append((f"{fam} {name} fp32 recompute={mode}",
                            [*f, *s, "pipeline.stages=2", "precision=fp32", f"model.recompute={mode}"]))
            out.append((f"{fam} {name} fp32 4 ranks", [*f, *s, "pipeline.stages=4", "precision=fp32"]))
    # tensor parallelism: 2 stages x 2 tensor ranks (4 ranks), with and without sequence parallelism
    for fam in ("gpt", "llama"):
        for name in ("1f1b", "zb_h1", "seq1f1b"):
            for sp in (False, True):
                out.append((f"{fam} {name} fp32 tp2" + ("+sp" if sp else ""),
                            [*FAMILIES[fam], *SCHEDULES[name], "pipeline.stages=2", "precision=fp32",
                             "pipeline.tensor_parallel=2", f"pipeline.sequence_parallel={str(sp).lower()}"]))
    # every other runtime schedule once (gpt, fp32, 2 ranks), and the concurrent-branch model
    for name, s in MORE.items():
        out.append((f"gpt {name} fp32", ["model=gpt_tiny", *s, "pipeline.stages=2", "precision=fp32"]))
    for name, s in (("bapp", ["schedule=bapp", "pipeline.stages=2"]), ("1f1b", ["schedule=1f1b", "pipeline.stages=2"])):
        out.append((f"cbm {name} fp32", ["model=cbm_tiny", *s, "precision=fp32"]))
    out.append(("cbm 1f1b bf16", ["model=cbm_tiny", "schedule=1f1b", "pipeline.stages=2", "precision=bf16"]))
    out.append(("cbm 1f1b fp32 4 ranks", ["model=cbm_tiny", "schedule=1f1b", "pipeline.stages=4", "precision=fp32"]))
    out.append(("cbm bapp fp32 4 ranks", ["model=cbm_tiny", "schedule=bapp", "pipeline.stages=4", "precision=fp32",
                                          "model.text.n_layer=4", "model.vision.n_layer=4"]))  # a stage per layer
    if quick:
        keep = {"gpt 1f1b fp32", "gpt gpipe fp32", "gpt zb_h1 fp32", "llama 1f1b bf16", "bert 1f1b fp32",
                "gpt seq1f1b fp32", "gpt 1f1b fp32 recompute=full", "gpt zb_v fp32", "gpt 1f1b fp32 tp2+sp"}
        out = [c for c in out if c[0] in keep]
    return out


# Real widths (hidden 768-1024, 2k-4k tokens a microbatch, of 1-4 sequences), cut to two
# layers, one a stage, so that the whole set runs on a 2-core CPU in a few minutes: the
# widths where a small model's terms stop hiding the large ones (the loss over a 50k
# vocabulary, the K/V of a 4k-token prefix, a hidden state of several MiB). The shapes of
# the cases measured on an H200 (shared/measurements/h200-2026-11-28), at the same widths,
# and the families, Seq1F1B, the zero-bubble split, tensor + sequence parallelism, ZeRO-3.
_LLAMA_1K = ["model=llama_tiny", "model.hf.hidden_size=1024", "model.hf.intermediate_size=2816",
             "model.hf.num_hidden_layers=2", "model.hf.num_attention_heads=16", "model.hf.num_key_value_heads=4"]
_GPT = ["model.n_layer=2", "model.vocab_size=256"]  # gpt_small's and gpt_medium's widths, a byte vocabulary
REAL = {
    "real gpt_small 1f1b fp32 2k vocab50k": ["model=gpt_small", "model.n_layer=2", "model.seq_len=2048",
                                             "model.n_positions=2048", "pipeline.microbatch_size=1",
                                             "precision=fp32"],
    "real gpt_medium zb_h1 bf16 2k selective": ["model=gpt_medium", *_GPT, "model.seq_len=2048",
                                                "model.n_positions=2048", "schedule=zb_h1",
                                                "model.recompute=selective", "pipeline.microbatch_size=2",
                                                "precision=bf16"],
    "real gpt_small seq1f1b bf16 4k": ["model=gpt_small", *_GPT, "model.seq_len=4096", "model.n_positions=4096",
                                       "schedule=seq1f1b", "pipeline.segments=4", "pipeline.microbatch_size=1",
                                       "precision=bf16"],
    "real llama1k zb_h1 bf16 4k": [*_LLAMA_1K, "model.hf.max_position_embeddings=4096", "model.seq_len=4096",
                                   "schedule=zb_h1", "pipeline.microbatch_size=1", "precision=bf16"],
    "real llama1k seq1f1b fp32 4k": [*_LLAMA_1K, "model.hf.max_position_embeddings=4096", "model.seq_len=4096",
                                     "schedule=seq1f1b", "pipeline.segments=4", "pipeline.microbatch_size=1",
                                     "precision=fp32"],
    "real bert 1f1b fp32 2k": ["model=bert_tiny", "model.n_layer=2", "model.n_embd=768", "model.n_head=12",
                               "model.seq_len=2048", "model.n_positions=2048", "pipeline.microbatch_size=2",
                               "precision=fp32"],
    "real gpt_small tp2+sp bf16 4x1k": ["model=gpt_small", *_GPT, "pipeline.tensor_parallel=2",
                                        "pipeline.sequence_parallel=true", "pipeline.microbatch_size=4",
                                        "precision=bf16"],
    "real gpt_small zero3 dp2 fp32 4x1k": ["model=gpt_small", *_GPT, "pipeline.data_parallel=2", "pipeline.shard=full",
                                           "pipeline.microbatch_size=4", "precision=fp32"],
}
REAL_SHAPE = ["pipeline.stages=2", "pipeline.microbatches=4"]


def real_cases() -> list[tuple[str, list[str]]]:
    """(label, overrides) of the real-width cases (:data:`REAL`), each on 2 stages of 4 microbatches."""
    return [(label, [*REAL_SHAPE, *over]) for label, over in REAL.items()]


def product() -> list[tuple[str, list[str]]]:
    """The whole product the matrix is drawn from: every runtime schedule (:data:`SCHEDULES`,
    :data:`MORE`, BAPP) on 2 and 4 ranks, for each family and the cbm model, fp32 and bf16,
    recomputation none, selective and full (``--sample`` draws from it; a combination the
    config layer refuses, such as Seq1F1B on BERT, is reported and left out)."""
    models = {**FAMILIES, "cbm": ["model=cbm_tiny"]}
    schedules = {**SCHEDULES, **MORE, "bapp": ["schedule=bapp"]}
    deeper = {"gpt": ["model.n_layer=8"], "bert": ["model.n_layer=8"], "llama": ["model.hf.num_hidden_layers=8"]}
    out = []
    for fam, f in models.items():
        for name, s in schedules.items():
            if (fam == "cbm") != (name == "bapp") and not (fam == "cbm" and name in CBM_SCHEDULES):
                continue
            for ranks in (2, 4):
                if ranks == 4 and fam in deeper and any(o.startswith("pipeline.virtual_stages=") for o in s):
                    s = [*s, *deeper[fam]]  # a stage per layer at least
                for precision in ("fp32", "bf16"):
                    for mode in ("none", "selective", "full"):
                        label = f"{fam} {name} {precision}" + (f" recompute={mode}" if mode != "none" else "") \
                            + (" 4 ranks" if ranks == 4 else "")
                        out.append((label, [*f, *s, f"pipeline.stages={ranks}", f"precision={precision}",
                                            f"model.recompute={mode}"]))
    return out


def _gpu_topology() -> str:
    """The simulated topology for this machine's GPU: its device preset holds what the
    math libraries keep (Hopper's cuBLAS workspaces are four times Ampere's)."""
    import torch

    hopper = torch.cuda.get_device_capability()[0] >= 9
    return "topology=cluster topology.nodes=1 topology.device=" + ("h100-80g" if hopper else "a100-80g")


def measure(label: str, overrides: list[str], work: Path, device: str = "cpu", one_stage: bool = False,
            extra: tuple = ()) -> list[dict]:
    """Train and simulate one case: a row per device."""
    over = [*SHAPE, *overrides, *extra]
    if one_stage:
        over = [o for o in over if not o.startswith(("pipeline.stages=", "pipeline.data_parallel="))]
        over += ["pipeline.stages=1"]
    run_dir = work / _folder(label)
    gpu = ["runtime.backend=gloo"] if device == "cuda" else []  # ranks share the GPU
    cfg = compose("train", [*over, "trainer.steps=2", "trainer.val_every=0", "logger=none", "runtime.memory=profile",
                            f"runtime.device={device}", *gpu])
    cfg.trainer.steps = _steps(cfg)
    inputs = prepare_training(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    launch(TrainJob(inputs.plan, str(run_dir)))
    summary = json.loads((run_dir / "summary.json").read_text())
    topology = "topology=local_cpu" if device == "cpu" else _gpu_topology()
    # the trained job's pipeline, every key (pipeflow-simulate's own defaults are a cluster's)
    shape = [f"pipeline.{k}={v}" for k, v in cfg.pipeline.items()]
    plan = inputs.schedule.meta.get("plan")
    if plan is not None:  # schedule=planned: the plan the run trained (another topology plans its own)
        (run_dir / "plan.json").write_text(json.dumps(plan))
        shape.append(f"schedule.plan={run_dir / 'plan.json'}")
    # a device of the schedule is T ranks with tensor parallelism (rank = device x T + t):
    # each device's fullest rank against the device the simulator prices
    T = int(cfg.pipeline.get("tensor_parallel", 1) or 1)
    ranks = summary["memory_profile"]
    profiles = [max(ranks[d:d + T], key=lambda m: m.get("allocator_peak_bytes", m["peak_bytes"]))
                for d in range(0, len(ranks), T)]
    # what the simulator says each device holds in the action where its rank peaked, too
    actions = [meas.get("peak_action") for meas in profiles]
    sim = run_simulation(compose("simulate", [*over, *shape, "draw=false", *topology.split()]), run_dir / "sim",
                         actions=actions)
    rows = []
    for dev, (meas, simd) in enumerate(zip(profiles, sim["per_device"])):
        # on CUDA the allocator's own peak is the measurement (the history's replay counts
        # each block as asked for, rounded to 512 bytes; a reused block's slack is not in it)
        peak, predicted = meas.get("allocator_peak_bytes", meas["peak_bytes"]), simd["peak_memory_bytes"]
        worst, share = _most_off(meas["at_peak"], simd["memory_at_peak"], peak)
        # at the measured peak's action (where the simulator peaks in another whose total is
        # within its error of this one's, the two split the same bytes differently)
        there = simd.get("memory_at_action", {}).get("at", simd["memory_at_peak"])
        action_worst, action_share = _most_off(meas["at_peak"], there, peak)
        rows.append({"case": label, "device": dev, "measured_bytes": peak, "simulated_bytes": predicted,
                     "ratio": predicted / peak, "worst": worst, "worst_share": share,
                     "action_worst": action_worst, "action_share": action_share,
                     "measured": meas["at_peak"], "simulated": simd["memory_at_peak"], "simulated_at_action": there,
                     "simulated_peak_action": simd.get("memory_peak_action"),
                     **({"peak_action": meas["peak_action"]} if meas.get("peak_action") else {}),
                     **({"allocator_peak_bytes": meas["allocator_peak_bytes"], "profile_peak_bytes": meas["peak_bytes"]}
                        if "allocator_peak_bytes" in meas else {})})
    return rows


def _folder(label: str) -> str:
    """A case's run folder: its label as a file name, a long one cut and told apart by a hash
    (a folder name has at most 255 bytes; a case's overrides may run to any length)."""
    import hashlib
    import re

    name = re.sub(r"[^A-Za-z0-9._+-]+", "_", label.replace("=", "-")).strip("_") or "case"
    if len(name) <= 80:
        return name
    return f"{name[:64]}-{hashlib.sha1(label.encode()).hexdigest()[:12]}"


def _steps(cfg) -> int:
    """How many steps a case trains: 2, so the measured step has every optimizer state and
    every buffer the first step makes; 3 for an asynchronous schedule, whose last stage's
    copy of a tied weight takes its first update (and AdamW makes its moments) only at
    the second step's end, after that step's peak (:func:`~pipeflow.schedules.versions.tied_update_plan`)."""
    from pipeflow.schedules.registry import get_spec

    return 3 if get_spec(cfg.schedule.name).asynchronous else 2


def _most_off(measured: dict, simulated: dict, peak: float) -> tuple[str, float]:
    """The group (:data:`GROUPS`) whose simulated bytes differ most from the measured
    ones, and by what share of the measured peak."""
    diffs = {g: (sum(simulated.get(c, 0.0) for c in s) - sum(measured.get(c, 0) for c in m))
             for g, (m, s) in GROUPS.items()}
    worst = max(diffs, key=lambda g: abs(diffs[g]))
    return worst, diffs[worst] / peak


def table(rows: list[dict]) -> str:
    mib = 2**20
    cuda = any("allocator_peak_bytes" in r for r in rows)
    head = ("| case | device | measured MiB | simulated MiB | simulated / measured | most off (share of peak) "
            "| peaks in (measured / simulated) | most off in the measured peak's action |")
    lines = [head + (" profile's peak MiB |" if cuda else ""), "|---|---|---|---|---|---|---|---|" + ("---|" if cuda else "")]
    for r in rows:
        line = (f"| {r['case']} | {r['device']} | {r['measured_bytes'] / mib:.2f} | {r['simulated_bytes'] / mib:.2f} "
                f"| {r['ratio']:.3f} | {r['worst']} {r['worst_share']:+.1%} "
                f"| {r.get('peak_action') or '-'} / {r.get('simulated_peak_action') or '-'} "
                f"| {r.get('action_worst', r['worst'])} {r.get('action_share', r['worst_share']):+.1%} |")
        if cuda:
            line += f" {r.get('profile_peak_bytes', 0) / mib:.2f} |"
        lines.append(line)
    ratios = [r["ratio"] for r in rows]
    if ratios:
        within = sum(abs(x - 1) <= 0.03 for x in ratios)
        categories = sum(abs(r["worst_share"]) <= 0.05 for r in rows)
        same = sum(abs(r.get("action_share", r["worst_share"])) <= 0.05 for r in rows)
        either = sum(min(abs(r["worst_share"]), abs(r.get("action_share", r["worst_share"]))) <= 0.05 for r in rows)
        lines.append(f"\n{len(rows)} devices: simulated / measured {min(ratios):.3f} to {max(ratios):.3f}; "
                     f"{within} within 3%; {categories} with every category within 5% of the peak at the "
                     f"simulator's own peak, {same} in the action where the rank peaked, {either} at one of the two")
    return "\n".join(lines)


def results(quick: bool = False, only: str | None = None, device: str = "cpu", one_stage: bool = False,
            extra: tuple = (), sample: int = 0, seed: int = 0, shard: tuple[int, int] = (0, 1),
            whole: bool = False, real: bool = False) -> list[dict]:
    """The rows of the chosen cases (``only``: comma-separated substrings of their
    labels, each of them one or several joined by ``&``, all in the label; ``sample``:
    that many drawn from :func:`product` instead, those of the matrix left out; ``whole``:
    every case of the product; ``real``: the real-width cases (:data:`REAL`) instead; ``shard`` (k, n): every n-th case from the k-th, for n runs
    side by side); a case that cannot run here is reported on stderr and left out."""
    wanted = [w.strip() for w in only.split(",")] if only else None
    pool = product() if whole else real_cases() if real else cases(quick)
    if sample and not whole:
        import random

        matrix = {c[0] for c in pool}
        pool = random.Random(seed).sample([c for c in product() if c[0] not in matrix], sample)
    chosen = [c for c in pool if wanted is None or any(all(p in c[0] for p in w.split("&")) for w in wanted)
              ][shard[0]::shard[1]]
    return measure_all(chosen, device, one_stage, extra)


def measure_all(chosen: list[tuple[str, list[str]]], device: str = "cpu", one_stage: bool = False,
                extra: tuple = ()) -> list[dict]:
    """The rows of every case in ``chosen``; a case that cannot run here (the config layer
    refuses it, or its ranks fail) is reported on stderr, in a line, and left out."""
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench_memory_") as tmp:
        for n, (label, over) in enumerate(chosen):
            try:
                rows += measure(label, over, Path(tmp) / str(n), device, one_stage, extra)
            except Exception as err:  # noqa: BLE001 - reported, not fatal
                reason = " ".join(str(err).split()) or type(err).__name__
                print(f"{label}: not measured: {reason}", file=sys.stderr)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one case per concern")
    ap.add_argument("--only", default=None, help="cases whose label contains one of these (comma-separated; "
                                                 "'llama&recompute=full': both)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--one-stage", action="store_true", help="every case as one stage in one process")
    ap.add_argument("--set", default="", help="overrides added to every case, space-separated (model.seq_len=1024 ...)")
    ap.add_argument("--sample", type=int, default=0,
                    help="this many cases drawn from the whole product (every schedule, rank count, model, precision "
                         "and recomputation), outside the matrix")
    ap.add_argument("--seed", type=int, default=0, help="--sample's draw")
    ap.add_argument("--product", action="store_true",
                    help="every case of the whole product, the matrix's too (684; --only picks among them: "
                         "--product --only 'cbm zb_h1,cbm zb_h2')")
    ap.add_argument("--real", action="store_true",
                    help="the real-width cases instead (hidden 768-1024, 2k-4k tokens: a few minutes on 2 cores)")
    ap.add_argument("--case", action="append", default=[],
                    help="one case of your own instead, its overrides space-separated (repeatable): "
                         "--case 'model=cbm_tiny schedule=zb_h2 pipeline.stages=2 precision=fp32'")
    ap.add_argument("--shard", default="0/1", help="k/n: every n-th case from the k-th (n runs side by side)")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args(argv)
    if args.case:
        rows = measure_all([(case, case.split()) for case in args.case], args.device, args.one_stage,
                           tuple(args.set.split()))
    else:
        k, n = (int(x) for x in args.shard.split("/"))
        rows = results(args.quick, args.only, args.device, args.one_stage, tuple(args.set.split()), args.sample,
                       args.seed, (k, n), args.product, args.real)
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
