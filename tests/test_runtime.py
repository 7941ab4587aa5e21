"""The runtime against single-device training, on real CPU ranks over gloo.

Every schedule, 2 and 4 stages: after one step on the same global batch every
parameter's gradient equals the pipeline.stages=1 reference, and five steps of losses
agree to 1e-4 relative. Also: a crashed or killed rank ends the job with that rank's
error and leaves no process behind, and a resumed run continues exactly.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

import pipeline_runs
from pipeflow.runtime.launch import JobFailed
from pipeflow.schedules.registry import specs

pytestmark = pytest.mark.slow  # starts ranks or subprocesses: make test-fast leaves it out

SMALL = pipeline_runs.GPT_SMALL

# every registered synchronous chain schedule the runtime runs from its generator (the
# segmented ones: test_seq_runtime; asynchronous: test_async_runtime; bapp: test_cbm_runtime)
SPECS = {s.name: s for s in specs() if s.runtime and s.generator is not None and s.sized and not s.asynchronous
         and not s.segments and not s.branch_aware}
CASES = [(name, p) for p in (2, 4) for name in SPECS]


def train(run_dir: Path, *overrides: str) -> dict:
    return pipeline_runs.train(run_dir, [*SMALL, *overrides], tied=pipeline_runs.GPT_TIED)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return train(tmp_path_factory.mktemp("ref"), "pipeline.stages=1", "trainer.steps=5", "runtime.dump_grads=true")


def test_a_step_that_reads_the_device_only_at_its_end_trains_as_one_device(reference, tmp_path):
    """runtime.cuda_paths=[reads]: CPU ranks take an accelerator's step, which reads no
    device value mid-step (the clip's factor on the device, the norm and the loss read
    once the step is launched): the single device's gradients and losses, under ZB-H1 (a
    step where W's follow the last B's)."""
    run = train(tmp_path, "schedule=zb_h1", "pipeline.stages=2", "trainer.steps=5", "runtime.dump_grads=true",
                "runtime.cuda_paths=[reads]")
    pipeline_runs.assert_same_grads(run["grads"], reference["grads"])
    assert run["losses"] == pytest.approx(reference["losses"], rel=1e-4)
    norms = [row["grad_norm"] for row in pipeline_runs.metrics(tmp_path)]
    # read at each step's end; over optim.grad_clip=1, so every step's factor clipped on the device
    assert len(norms) == 5 and all(isinstance(n, float) and n > 1.0 for n in norms)


@pytest.mark.parametrize("name,p", CASES)
def test_gradients_and_losses_match_single_device(name, p, reference, tmp_path):
    extra = ["pipeline.virtual_stages=2"] if SPECS[name].virtual_stages else []
    if name == "dualpipe_v" and p == 4:  # two microbatches per stage of the V: the same 8 sequences as 8 x 1
        extra += ["pipeline.microbatches=8", "pipeline.microbatch_size=1"]
    run = train(tmp_path, f"schedule={name}", f"pipeline.stages={p}", "trainer.steps=5", "runtime.dump_grads=true", *extra)
    # replicas (chimera) and the tied embedding's copies each hold the full gradient
    pipeline_runs.assert_same_grads(run["grads"], reference["grads"])
    if name == "chimera":
        assert len(run["grads"]["h.0.attn.c_attn.weight"]) == 2  # both replicas reported
    assert len(run["losses"]) == len(reference["losses"]) == 5
    for a, b in zip(run["losses"], reference["losses"]):
        assert abs(a - b) <= 1e-4 * abs(b)
    # the losses moved: five real optimizer steps happened
    assert run["losses"][0] != run["losses"][-1]


def test_measured_timeline_and_summary(tmp_path):
    run = train(tmp_path, "schedule=1f1b", "pipeline.stages=2", "trainer.steps=3", "trainer.val_every=3")
    s = run["summary"]
    assert s["world_size"] == 2 and len(s["peak_memory_bytes"]) == 2 and min(s["peak_memory_bytes"]) > 0
    assert s["final_val_loss"] is not None and 0 <= s["measured_bubble_ratio"] < 1
    from pipeflow.formats.timeline import Timeline

    tl = Timeline.load(tmp_path / "timeline.json")
    assert tl.source == "measured" and tl.num_devices == 2
    names = {e.name for e in tl.events}
    assert {"0F0", "1F3", "0B3", "1B0", "0S@0", "1S@0"} <= names
    # each rank's compute events are in its schedule order and do not overlap
    for dev in (0, 1):
        evs = sorted((e for e in tl.events if e.device == dev and e.stream == "compute"), key=lambda e: e.start)
        assert all(a.end <= b.start + 1e-9 for a, b in zip(evs, evs[1:]))
    # measured spans are compute only (waiting for a message is idle): a stage's forward
    # starts after its predecessor's forward ended, a backward after its successor's
    span = {e.name: e for e in tl.events if e.stream == "compute"}
    for mb in range(4):
        assert span[f"1F{mb}"].start >= span[f"0F{mb}"].end
        assert span[f"0B{mb}"].start >= span[f"1B{mb}"].end
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3]
    assert all({"loss", "lr", "tokens_per_s", "step_time"} <= x.keys() for x in lines)
    assert "val_loss" in lines[-1]


@pytest.mark.parametrize("mode", ["raise", "kill"])
def test_a_failing_rank_ends_the_job(mode, tmp_path):
    t0 = time.monotonic()
    with pytest.raises(JobFailed) as e:
        train(tmp_path, "schedule=1f1b", "pipeline.stages=4", "trainer.steps=50", "runtime.fail_at_step=3",
              "runtime.fail_rank=2", f"runtime.fail_mode={mode}", "runtime.timeout_s=30")
    assert time.monotonic() - t0 < 60
    assert e.value.rank == 2
    assert ("injected failure on rank 2 at step 3" if mode == "raise" else "SIGKILL") in str(e.value)
    # the ranks the launcher stopped are no interruption: failure.json, and no summary
    assert json.loads((tmp_path / "failure.json").read_text())["rank"] == 2
    assert not (tmp_path / "summary.json").exists()
    assert multiprocessing.active_children() == [] or all(
        "forkserver" in (c.name or "") for c in multiprocessing.active_children()
    )


def test_killed_rank_through_the_cli_leaves_nothing_behind(tmp_path):
    marker = f"pipeflow-test-{uuid.uuid4()}"
    env = dict(os.environ, PIPEFLOW_TEST_MARKER=marker)
    proc = subprocess.run(
        [sys.executable, "-m", "pipeflow.train", *SMALL, "pipeline.stages=2", "trainer.steps=50",
         "runtime.fail_at_step=2", "runtime.fail_rank=1", "runtime.fail_mode=kill", f"hydra.run.dir={tmp_path}"],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode != 0
    assert "rank 1" in proc.stderr and "SIGKILL" in proc.stderr
    time.sleep(0.5)
    leftovers = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if marker.encode() in Path(f"/proc/{pid}/environ").read_bytes():
                    leftovers.append(pid)
            except OSError:
                pass
    assert leftovers == []


def test_resume_continues_exactly(tmp_path):
    full = train(tmp_path / "full", "schedule=1f1b", "pipeline.stages=2", "trainer.steps=10", "trainer.save_every=5")
    at5 = tmp_path / "full" / "checkpoints" / "step_0000005"
    assert at5.is_dir() and (tmp_path / "full" / "checkpoints" / "latest").read_text().strip() == "10"
    resumed = train(tmp_path / "resumed", "schedule=1f1b", "pipeline.stages=2", "trainer.steps=10", f"resume={at5}")
    steps = [json.loads(x)["step"] for x in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [6, 7, 8, 9, 10]
    assert resumed["losses"] == pytest.approx(full["losses"][5:], rel=1e-6)
    assert resumed["summary"]["resumed_from"] == 5


def test_torchrun_adopts_its_ranks(tmp_path):
    """Under torchrun the trainer starts no processes of its own: each torchrun process
    is one rank, and all of them write to rank 0's run folder."""
    torchrun = Path(sys.executable).with_name("torchrun")
    proc = subprocess.run(
        [str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "pipeflow.train", *SMALL,
         "pipeline.stages=2", "trainer.steps=2", f"hydra.run.dir={tmp_path}"],
        capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 2
    assert sorted(p.name for p in (tmp_path / "checkpoints" / "step_0000002").iterdir()) == ["meta.json", "rank0.pt", "rank1.pt"]


@pytest.mark.parametrize("model", ["gpt_tiny", "bert_tiny", "llama_tiny", "qwen2_tiny", "cbm_tiny"])
def test_the_plans_tied_stages_are_the_stages_whose_modules_hold_a_tied_copy(model):
    """Which stages share the embedding's weight is decided once, in the plan (the family's
    rule), and the modules the ranks build hold their tied copies on exactly those."""
    import torch

    from pipeflow.config import compose, prepare_training

    plan = prepare_training(compose("train", [f"model={model}", "pipeline.stages=3", "logger=none"])).plan
    adapter = plan.adapter.build(torch.device("cpu"))
    holding = {s for s in range(plan.schedule.num_stages) if getattr(adapter.build_stage(s), "tied_parameters",
                                                                      lambda: [])()}
    assert holding == set(plan.tied_stages)
    assert bool(holding) == (model in ("gpt_tiny", "bert_tiny", "qwen2_tiny"))


@pytest.mark.parametrize("norm", [0.3, 7.0], ids=["under", "over"])
def test_the_clip_on_the_device_is_the_hosts_bit_for_bit(norm):
    """The clip an accelerator's rank applies without reading the norm (a device tensor:
    its factor at most 1, applied always) leaves the gradients the host's clip leaves
    (a float: applied only where it clips), whether or not the norm is over the clip."""
    import torch

    from pipeflow.runtime.executor import clip_gradients

    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(33, 17, generator=gen), torch.randn(5, generator=gen)]
    host, device = [g.clone() for g in grads], [g.clone() for g in grads]
    clip_gradients(host, norm, 1.0)
    clip_gradients(device, torch.tensor(norm, dtype=torch.float64), 1.0)
    assert all(torch.equal(a, b) for a, b in zip(host, device))
    assert all(torch.equal(a, g) for a, g in zip(host, grads)) is (norm < 1.0)
