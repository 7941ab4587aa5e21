"""``python -m pipeflow.measure_device``: the operator sweep's file on CPU at smoke sizes,
and the flags it refuses before measuring anything.

What is checked is the file's structure (every section, its status, its rows' fields and
that each measured time is a positive number), never how fast anything was.
"""

from __future__ import annotations

import json
import statistics

import pytest

from pipeflow import measure_device
from pipeflow.topology import op_sweep
from pipeflow.topology.presets import PROFILES

ROW_FIELDS = {  # the fields other code reads from each section's rows
    "gemm_bf16": {"shape", "m", "k", "n", "dtype", "flop", "fwd_s", "dgrad_s", "wgrad_s"},
    "gemm_fp32_grid": {"shape", "m", "k", "n", "dtype", "flop", "fwd_s", "dgrad_s", "wgrad_s"},
    "sdpa_bf16": {"b", "h", "s", "d", "causal", "dtype", "fwd_s", "fwd_bwd_s"},
    "elementwise": {"op", "dtype", "rows", "hidden", "input_bytes", "fwd_s", "fwd_bytes"},
    "cross_entropy": {"tokens", "vocab", "dtype", "logit_bytes", "fwd_s", "fwd_bwd_s"},
    "adamw": {"params", "tensors", "impl", "s"},
    "grad_norm": {"params", "tensors", "s", "scale_s"},
    "gemm_fp32": {"m", "k", "n", "precision", "s"},
    "launch": {"op"},
    "blocks": {"family", "model", "tokens", "F_s", "B_s", "I_s", "W_s", "kernels"},
    "pipeline": {"reference", "host", "times", "priced", "in_step", "sync_s", "sync_collectives"},
}


def _times(section: str, row: dict) -> list:
    """A row's measured seconds: its ``*_s`` and ``s_per_*`` fields, its ``s`` (attention's
    is the sequence length) and its timing's median."""
    found = [v for k, v in row.items() if k.endswith("_s") or k.startswith("s_per_")]
    found += [row["s"]] if "s" in row and section != "sdpa_bf16" else []
    return found + [v["s"] for v in row.values() if isinstance(v, dict) and "s" in v]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    import torch

    out = tmp_path_factory.mktemp("measure") / "device_profile.json"
    threads = torch.get_num_threads()
    # one thread, as pipeflow-train's CPU ranks run: on a shared 2-core host two threads at
    # times make the smoke sizes' tiny calls wait on each other (once 28 s in place of 3 s)
    rc = measure_device.main(["--smoke", "--device", "cpu", "--budget-s", "20", "--threads", "1", "--out", str(out)])
    return rc, json.loads(out.read_text()), threads == torch.get_num_threads()


def test_the_smoke_sweep_writes_every_section(smoke):
    rc, doc, restored = smoke
    assert rc == 0 and restored and doc["host"]["torch_threads"] == 1
    assert doc["kind"] == "pipeflow-op-sweep" and doc["version"] == 1
    assert doc["device"] == "cpu" and doc["status"] == "ok" and doc["budget_s"] == 20.0
    assert {"processor", "machine", "cpus", "torch_threads"} <= set(doc["host"])
    assert "cpu_isa" in doc and "torch" in doc and "timing" in doc
    # the CPU's own sections: each family's block, and the reference pipeline calibrated
    assert [name for name, _, _ in op_sweep.CPU_SECTIONS] + ["blocks", "pipeline"] == list(doc["sections"])
    for name, sec in doc["sections"].items():
        assert sec["status"] == "ok", (name, sec.get("error"))
        assert sec["rows"] and sec["seconds"] >= 0


def test_every_row_has_its_fields_and_positive_times(smoke):
    _, doc, _ = smoke
    for name, sec in doc["sections"].items():
        timed = [row for row in sec["rows"] if "skipped" not in row]
        assert timed, name
        for row in timed:
            assert ROW_FIELDS[name] <= set(row), (name, row)
            times = _times(name, row)
            assert times and all(isinstance(t, float) and t > 0 for t in times), (name, row)
    dtypes = {sec: {r["dtype"] for r in doc["sections"][sec]["rows"]} for sec in ("gemm_bf16", "gemm_fp32_grid")}
    assert dtypes == {"gemm_bf16": {"bf16"}, "gemm_fp32_grid": {"fp32"}}


def test_the_grids_keep_the_gpu_sizes_and_scale_the_cpu_ones():
    gpu, cpu = op_sweep.grid_for("cuda", False), op_sweep.grid_for("cpu", False)
    assert gpu.gemm_ms == [512, 1024, 2048, 4096, 8192, 16384, 32768] and gpu.gemm_shapes == op_sweep.GEMM_SHAPES
    assert min(cpu.gemm_ms) == 128 and max(cpu.gemm_ms) == 2048
    assert cpu.gemm_shapes["gpt_small fc1"] == (768, 3072)
    assert {s for _, _, s, _, _ in cpu.sdpa} == {128, 256, 512, 1024} and {d for *_, d, _ in cpu.sdpa} == {32, 64}
    assert cpu.elementwise_sizes[0] == 16 * 2**10 and cpu.elementwise_sizes[-1] == 64 * 2**20
    assert cpu.ce_vocabs == (256, 8192, 50257) and cpu.adamw[-1][0] == 2 * 10**7
    assert "gemm_fp32_grid" not in [name for name, _, _ in op_sweep.SECTIONS]


def test_the_cpu_sections_give_the_profile_its_block_times_and_host(smoke, tmp_path):
    """What blocks and pipeline measured reaches the profile: per family, a block's time
    less its kernels' calls; the reference pipeline's host keys and its time per block
    beyond the price, which the local_cpu topology and the operator cost then read."""
    from pipeflow.config import compose, prepare_simulation
    from pipeflow.planning.from_sweep import from_sweep

    _, doc, _ = smoke
    prof = from_sweep(doc, "smoke")
    blocks = {r["family"]: r for r in doc["sections"]["blocks"]["rows"]}
    assert set(blocks) == {"gpt", "bert", "hf_causal"}
    gpt = blocks["gpt"]
    for kind in "FW":
        assert prof.block_host[("gpt", kind)] == pytest.approx(max(gpt[f"{kind}_s"] - gpt["kernels"][kind] * prof.launch_s, 0))
    pipe = doc["sections"]["pipeline"]["rows"][0]
    assert set(pipe["host"]) == {"cores", "contention", "latency", "bandwidth", "message_host", "collective_bandwidth"}
    assert set(pipe["in_step"]) == {"F", "B", "I", "W"} and pipe["in_step"]["W"] == 0.0
    assert prof.host == pipe["host"] and prof.in_step == pipe["in_step"]
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(doc))
    over = ["model=gpt_tiny", "model.n_layer=4", "pipeline.stages=2", "cost=analytic", "topology=local_cpu",
            f"topology.device_profile={path}"]
    inputs = prepare_simulation(compose("simulate", over))
    dev = inputs.topology.devices[0]
    assert inputs.topology.contention == pipe["host"]["contention"] and dev.profile == str(path)
    # an action: its operators as priced, plus per block its host time alone and in a step
    ops = inputs.cost.operators("F", 1)
    alone = prof.action(ops)[0]
    per_block = max(prof.block_host[("gpt", "F")] + pipe["in_step"]["F"], 0.0)
    assert inputs.cost.compute_time("F", 1, 0, dev) == pytest.approx(alone + 2 * per_block, rel=1e-12)
    # the step's synchronisation: the reference's (gpt_tiny, tied, 2 ranks) is what it
    # measured; 4 ranks' world all-reduce takes 3 hops, an untied model has no embedding's
    rate = pipe["host"]["collective_bandwidth"]
    assert pipe["sync_collectives"] == [[16.0, 2], [4.0 * 256 * 128, 2]]
    assert inputs.cost.step_sync == pytest.approx(pipe["sync_s"], rel=1e-9)
    hop = prof.sync_hop_s
    assert hop == pytest.approx((pipe["sync_s"] - (8.0 + 65536.0) / rate) / 2, rel=1e-9)
    four = prepare_simulation(compose("simulate", [*over, "pipeline.stages=4"])).cost.step_sync
    assert four == pytest.approx(3 * hop + 0.75 * 16 / rate + hop + 65536.0 / rate, rel=1e-9)
    llama = prepare_simulation(compose("simulate", [*over[1:], "model=llama_tiny"])).cost.step_sync
    assert llama == pytest.approx(hop + 8.0 / rate, rel=1e-9)
    # ZB-V's first device holds the first stage and the last: the tied copies sum on it, not over gloo
    v = prepare_simulation(compose("simulate", [*over, "schedule=zb_v", "pipeline.virtual_stages=2"])).cost.step_sync
    assert v == pytest.approx(hop + 8.0 / rate, rel=1e-9)


def test_a_section_cut_short_says_so(tmp_path):
    sw = op_sweep.Sweep(tmp_path / "ops.json", 20.0, "cpu", smoke=True, say=lambda line: None)
    sec = sw.section("gemm_bf16", 1.0, lambda rows, deadline: rows.append({"m": 1}) or False)
    assert sec["status"] == "truncated (deadline)" and sec["rows"] == [{"m": 1}]
    assert json.loads((tmp_path / "ops.json").read_text())["sections"]["gemm_bf16"]["status"] == "truncated (deadline)"


@pytest.mark.parametrize("flags, named", [
    (["--device", "tpu"], "--device=tpu"),
    (["--budget-s", "0"], "--budget-s=0"),
    (["--budget-s", "-5"], "--budget-s=-5"),
    (["--budget-s", "soon"], "--budget-s=soon"),
    (["--budget-s", "1"], "--budget-s=1"),  # too short for any section: a file that would price nothing
    (["--threads", "0"], "--threads=0"),
    (["--ranks", "1"], "--ranks=1"),
    (["--ranks", "two"], "--ranks=two"),
])
def test_bad_flags_exit_2_naming_the_flag_and_writing_nothing(tmp_path, capsys, flags, named):
    out = tmp_path / "device_profile.json"
    assert measure_device.main([*flags, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(named) and "allowed values" in err
    assert list(tmp_path.iterdir()) == []


def test_cuda_asked_where_none_is_visible_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(measure_device, "cuda_visible", lambda: False)
    assert measure_device.main(["--device", "cuda", "--out", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("--device=cuda") and "auto, cpu" in err
    assert list(tmp_path.iterdir()) == []


def test_the_operator_classes_of_a_trace():
    """Each profiler event's class: by its name, and by the scopes around it (the
    optimizer's step and the step's synchronisation, a cross entropy)."""
    from pipeflow.runtime.op_trace import SYNC_SCOPE, classify

    assert classify("aten::mm") == classify("aten::addmm") == "product"
    assert classify("aten::_scaled_dot_product_flash_attention_for_cpu_backward") == "attention"
    assert classify("aten::scaled_dot_product_attention") == "host"  # the wrapper: its dispatch alone
    assert classify("aten::native_layer_norm_backward") == "norm"
    assert classify("aten::gelu") == classify("aten::copy_") == "pointwise"
    assert classify("aten::_log_softmax") == "loss" and classify("aten::exp", ("aten::cross_entropy_loss",)) == "loss"
    assert classify("aten::mul_", ("aten::mul_", "Optimizer.step#AdamW.step")) == "optimizer"
    assert classify("aten::bmm", (SYNC_SCOPE,)) == "optimizer"  # the clip norm's squares
    assert classify("aten::view") == classify("AddmmBackward0") == "host"
    assert classify("c10d::send") == classify("gloo:all_reduce") == "comm"
    assert classify("pipeflow::action::0F1") is None


@pytest.mark.slow  # starts 2 ranks
def test_a_runs_trace_folds_into_its_profile(smoke, tmp_path):
    """runtime.trace_steps=1: each rank's operators by class in op_trace.json (the loss on
    the last stage's rank alone); fold_trace prices the same schedule with the profile, and
    the profile it writes prices each class's operators at the ratio times the price."""
    from pipeflow import fold_trace
    from pipeflow.config import compose, prepare_simulation
    from pipeflow.planning.from_sweep import load_profile
    from pipeline_runs import train

    _, doc, _ = smoke
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(doc))
    over = ["model=gpt_tiny", "model.n_layer=4", "model.n_embd=64", "model.seq_len=64", "pipeline.stages=2",
            "pipeline.microbatches=2", "pipeline.microbatch_size=2"]
    run = tmp_path / "run"
    train(run, [*over, "trainer.steps=2", "trainer.val_every=0", "trainer.val_batches=1",
                "trainer.timeline_step=null", "logger=none", "runtime.trace_steps=1"])
    ranks = json.loads((run / "op_trace.json").read_text())["ranks"]
    assert [r["steps"] for r in ranks] == [1, 1]
    for r in ranks:
        assert all(r["per_step"][c] > 0 for c in ("product", "attention", "norm", "pointwise", "optimizer", "comm"))
    assert ranks[0]["per_step"]["loss"] == 0 and ranks[1]["per_step"]["loss"] > 0
    # 2 microbatches: each rank sends 2 messages and receives 2 (its receives posted once)
    assert [r["posts_per_step"] for r in ranks] == [4, 4] and all(r["post_s"] > 0 for r in ranks)
    # the run's own config (no .hydra here: its config.json) folds as its overrides spelt out do
    own = tmp_path / "own.json"
    assert fold_trace.main([str(run), "--profile", str(profile), "--out", str(own)]) == 0
    fixed = tmp_path / "fixed.json"
    assert fold_trace.main([str(run), "--profile", str(profile), "--out", str(fixed), "--", *over]) == 0
    factors = json.loads(fixed.read_text())["corrections"]["classes"]
    assert json.loads(own.read_text())["corrections"]["classes"] == factors
    assert set(factors) == {"product", "attention", "norm", "pointwise", "loss", "optimizer"}
    price, note = fold_trace.priced(over, profile, "cpu")
    assert note is None
    assert factors["loss"] == pytest.approx(ranks[1]["per_step"]["loss"] / price[1]["loss"], rel=1e-9)
    # the corrected profile: every operator of a class at its factor times the price
    sim = ["model=gpt_tiny", "model.n_layer=4", "model.n_embd=64", "model.seq_len=64", "pipeline.stages=2",
           "cost=analytic", "topology=local_cpu"]
    ops = prepare_simulation(compose("simulate", [*sim, f"topology.device_profile={profile}"])).cost.operators("B", 1)
    before, after = load_profile(profile), load_profile(fixed)
    # the run's own cost of posting a message replaces the reference pipeline's
    posting = statistics.median(r["post_s"] for r in ranks)
    assert after.host["message_host"] == pytest.approx(posting, rel=1e-12) != before.host["message_host"]
    assert {k: v for k, v in after.host.items() if k != "message_host"} == \
        {k: v for k, v in before.host.items() if k != "message_host"}
    for op in ops:
        assert after.time(op) == pytest.approx(factors[op.cls] * before.time(op), rel=1e-12)
    # folding again multiplies the factors
    again = fold_trace.corrected(fixed, {"product": 2.0}, run, 1)["corrections"]["classes"]
    assert again["product"] == pytest.approx(2.0 * factors["product"]) and again["loss"] == factors["loss"]
    bad = {**doc, "corrections": {"classes": {"matmul": 1.1}}}
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="corrections .*matmul"):
        load_profile(tmp_path / "bad.json")


# ---------------------------------------------------------------- issue 76: nothing lost, one sentence a fault

H200 = PROFILES / "h200.json"  # the shipped sweep of an H200


def _as_cpu(tmp_path, name: str = "cpu.json"):
    """The shipped H200 sweep as if measured on a CPU (one thread issues and runs)."""
    sweep = json.loads(H200.read_text())
    sweep["device"] = "cpu"
    path = tmp_path / name
    path.write_text(json.dumps(sweep))
    return path


def _traced(tmp_path, overrides: list[str], ranks: int = 2):
    """A run folder as pipeflow-train leaves it (no ranks started): ``.hydra/config.yaml``,
    the composed config of ``overrides`` alone, and an op_trace.json of ``ranks`` ranks."""
    from omegaconf import OmegaConf

    from pipeflow.config import compose

    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    OmegaConf.save(compose("train", ["logger=none", *overrides]), run / ".hydra" / "config.yaml")
    per_step = {"product": 0.01, "attention": 0.002, "norm": 0.001, "pointwise": 0.003, "loss": 0.0,
                "optimizer": 0.001, "host": 0.002, "comm": 0.001}
    rows = [{"device": "cpu", "steps": 1, "per_step": {**per_step, "loss": 0.001 * (r == ranks - 1)}}
            for r in range(ranks)]
    (run / "op_trace.json").write_text(json.dumps({"ranks": rows}))
    return run


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_fold_prices_the_runs_own_config_not_the_simulators_defaults(tmp_path):
    """A run left at training's defaults (2 stages, 4 microbatches of 4) is priced as that
    job, the same as its keys spelt out, not as the simulator's defaults (4 stages of 8
    microbatches of 1: another job)."""
    from pipeflow import fold_trace

    profile, run = _as_cpu(tmp_path), _traced(tmp_path, [])
    own, note = fold_trace.priced(fold_trace.run_config(run, []), profile, "cpu", run)
    spelt, _ = fold_trace.priced(["model=gpt_tiny", "pipeline.stages=2", "pipeline.microbatches=4",
                                  "pipeline.microbatch_size=4"], profile, "cpu")
    assert note is None and len(own) == 2 and own == spelt
    # the last of the run's 2 stages holds the loss (priced as 2 of the simulator's 4 stages: on neither)
    assert own[0]["loss"] == 0 and own[1]["loss"] > 0
    other, _ = fold_trace.priced(["model=gpt_tiny", "pipeline.stages=4", "pipeline.microbatches=8",
                                  "pipeline.microbatch_size=1"], profile, "cpu")
    assert len(other) == 4 and other[:2] != own


@pytest.mark.parametrize("overrides, named", [
    (["pipeline.data_parallel=2"], "pipeline.data_parallel=2"),
    (["compile=true"], "compile=true"),
])
def test_fold_refuses_a_run_it_cannot_price_in_one_sentence(tmp_path, capsys, overrides, named):
    """A data-parallel run (4 ranks, as many as the simulator's default 4 stages) and a
    compiled one (whose refusal named keys fold_trace does not take) are refused, naming
    the key, before anything is priced or written."""
    from pipeflow import fold_trace

    profile, run = _as_cpu(tmp_path), _traced(tmp_path, overrides, ranks=4 if "data" in named else 2)
    out = tmp_path / "fixed.json"
    assert fold_trace.main([str(run), "--profile", str(profile), "--out", str(out)]) == 2
    assert _one_line(capsys).startswith(named) and capsys.readouterr().out == "" and not out.exists()


@pytest.mark.parametrize("text", ['{"ranks": [{"device": "cpu", "steps"', "{}", '{"ranks": []}', '{"ranks": [null]}',
                                  "[1, 2]"])
def test_fold_refuses_a_trace_cut_short_naming_the_file(tmp_path, capsys, text):
    from pipeflow import fold_trace

    profile, run = _as_cpu(tmp_path), _traced(tmp_path, [])
    (run / "op_trace.json").write_text(text)
    assert fold_trace.main([str(run), "--profile", str(profile)]) == 2
    err = _one_line(capsys)
    assert err.startswith(str(run / "op_trace.json")) and "runtime.trace_steps=N" in err


def test_fold_checks_out_before_any_work_and_writes_it_whole(tmp_path, capsys):
    """--out a folder or under a file: refused before the table; a write that fails (a
    full disk): one sentence, exit 1, nothing at --out; else the corrected profile."""
    import os

    from pipeflow import fold_trace

    profile, run = _as_cpu(tmp_path), _traced(tmp_path, [])
    (tmp_path / "a_file").write_text("")
    for out, said in ((tmp_path, "is a folder"), (tmp_path / "a_file" / "fixed.json", "is a file")):
        assert fold_trace.main([str(run), "--profile", str(profile), "--out", str(out)]) == 2
        err = _one_line(capsys)
        assert err.startswith(f"--out={out}") and said in err and capsys.readouterr().out == ""
    out = tmp_path / "fixed.json"
    (tmp_path / f".fixed.json.{os.getpid()}.tmp").symlink_to("/dev/full")  # (write_aside's temporary name)
    assert fold_trace.main([str(run), "--profile", str(profile), "--out", str(out)]) == 1
    assert _one_line(capsys) == f"could not write {out}: No space left on device" and not out.exists()
    assert fold_trace.main([str(run), "--profile", str(profile), "--out", str(out)]) == 0
    assert set(json.loads(out.read_text())["corrections"]["classes"]) >= {"product", "attention", "loss"}


def test_fold_of_a_gpu_run_prices_one_node_of_the_profiles_gpu(tmp_path):
    """Ranks that ran on GPUs under local_cpu (runtime.device=cuda) are priced as one node
    of the GPU the profile was measured on; a profile of a GPU no preset is says so."""
    from pipeflow import fold_trace

    run = _traced(tmp_path, [])
    rows, note = fold_trace.priced(fold_trace.run_config(run, []), H200, "cuda", run)
    assert len(rows) == 2 and rows[1]["loss"] > 0 and note is None
    sweep = json.loads(H200.read_text())
    sweep["gpu"] = "NVIDIA B200"
    other = tmp_path / "b200.json"
    other.write_text(json.dumps(sweep))
    _, note = fold_trace.priced(fold_trace.run_config(run, []), other, "cuda", run)
    assert note.startswith(f"topology.device_profile={other}") and "NVIDIA B200" in note and "a100-80g" in note


@pytest.mark.parametrize("topology, named", [
    (["topology=cluster"], "topology.device=a100-80g is a GPU"),
    (["topology=cluster", "topology.device=h200"], "topology.device=h200 is a GPU"),
    (["topology=local_cpu", "H200"], "topology=local_cpu's ranks are CPUs"),
])
def test_a_profile_of_another_kind_of_device_is_refused_naming_both(tmp_path, topology, named):
    """A CPU's profile on a GPU preset (A100s at this CPU's speed; an H200's memory with a
    CPU's times), or a GPU's on CPU ranks: refused, naming the file and the device."""
    from pipeflow.config import ConfigError, compose, prepare_simulation

    profile = H200 if "H200" in topology else _as_cpu(tmp_path)
    over = [o for o in topology if o != "H200"]
    with pytest.raises(ConfigError) as err:
        prepare_simulation(compose("simulate", [*over, f"topology.device_profile={profile}"]))
    said = str(err.value)
    assert said.startswith(f"topology.device_profile={profile}: measured on") and named in said
    assert len(said.splitlines()) == 1


def test_a_gpu_profile_of_another_model_is_said_in_one_line(tmp_path):
    from pipeflow.config import compose, prepare_simulation
    from pipeflow.topology.presets import profile_note

    same = prepare_simulation(compose("simulate", ["topology=cluster", "topology.device=h200",
                                                   f"topology.device_profile={H200}"])).topology
    assert profile_note(same.devices) is None
    other = prepare_simulation(compose("simulate", ["topology=cluster", f"topology.device_profile={H200}"])).topology
    note = profile_note(other.devices)
    assert "NVIDIA H200" in note and "topology.device=a100-80g" in note and len(note.splitlines()) == 1
    # the benchmarks' uses: a CPU profile on CPU ranks (bench_fidelity), the shipped one on its preset
    cpu = prepare_simulation(compose("simulate", ["topology=local_cpu", f"topology.device_profile={_as_cpu(tmp_path)}"]))
    assert cpu.topology.devices[0].profile and profile_note(cpu.topology.devices) is None


@pytest.mark.parametrize("topology", [["topology=local_cpu"], ["topology=cluster"]])
def test_a_profile_that_prices_nothing_is_refused_naming_key_and_file(tmp_path, topology):
    """A sweep whose budget ran out before any row: refused when the config is prepared
    (before, on a cluster, a traceback mid-simulation; on local_cpu a sentence naming neither)."""
    from pipeflow.config import ConfigError, compose, prepare_simulation

    device = "cpu" if topology == ["topology=local_cpu"] else "cuda"
    names = [name for name, _, _ in op_sweep.sections_for(device)]
    empty = {"kind": op_sweep.KIND, "version": 1, "status": "partial", "device": device, "gpu": "NVIDIA A100",
             "sections": {name: {"status": "skipped", "rows": []} for name in names}}
    path = tmp_path / "empty.json"
    path.write_text(json.dumps(empty))
    with pytest.raises(ConfigError, match=rf"^topology.device_profile={path}: the sweep has no launch rows"):
        prepare_simulation(compose("simulate", [*topology, f"topology.device_profile={path}"]))


def test_measuring_to_a_file_that_prices_nothing_says_so_and_exits_1(tmp_path, capsys, monkeypatch):
    """A sweep whose budget skipped the sections a step needs: not 'prices with it' but
    one line naming the file, what it lacks and the budget."""
    def skipped(path, budget, device, **_):
        doc = {"kind": op_sweep.KIND, "version": 1, "status": "partial", "device": device, "seconds": 1.0,
               "sections": {name: {"status": "skipped", "rows": []} for name, _, _ in op_sweep.sections_for(device)}}
        op_sweep.write_json(path, doc)
        return doc

    monkeypatch.setattr(measure_device, "sweep", skipped)
    out = tmp_path / "p.json"
    assert measure_device.main(["--device", "cpu", "--ranks", "0", "--budget-s", "20", "--out", str(out)]) == 1
    err = _one_line(capsys)
    assert err.startswith(f"{out} cannot price a step") and "--budget-s=20" in err
    assert "prices with it" not in capsys.readouterr().out


@pytest.mark.parametrize("where", ["under_a_file", "proc"])
def test_measuring_to_an_out_that_cannot_be_written_is_refused_before_measuring(tmp_path, capsys, monkeypatch,
                                                                                where):
    monkeypatch.setattr(measure_device, "sweep", lambda *a, **k: pytest.fail("measured"))
    (tmp_path / "a_file").write_text("")
    out = tmp_path / "a_file" / "p.json" if where == "under_a_file" else "/proc/pipeflow-none/p.json"
    assert measure_device.main(["--device", "cpu", "--out", str(out)]) == 2
    err = _one_line(capsys)
    assert err.startswith(f"--out={out}: ") and "allowed values" in err
    assert [p.name for p in tmp_path.iterdir()] == ["a_file"]


def test_a_sweep_whose_file_cannot_be_written_stops_at_once(tmp_path, capsys, monkeypatch):
    """A full disk mid-sweep: the section's write is not recorded as the section's error
    (the sweep would measure on for nothing); the app says it in one line, exit 1."""
    import os

    from pipeflow.faults import WriteFailed

    path = tmp_path / "ops.json"
    sw = op_sweep.Sweep(path, 20.0, "cpu", smoke=True, say=lambda line: None)
    sw.save()
    (tmp_path / f".ops.json.{os.getpid()}.tmp").symlink_to("/dev/full")
    with pytest.raises(WriteFailed, match="No space left"):
        sw.section("gemm_bf16", 1.0, lambda rows, deadline: rows.append({"m": 1}) or sw.save())
    assert json.loads(path.read_text())["sections"] == {}  # the file as last written whole

    def full(path, *a, **k):
        raise WriteFailed(path, OSError(28, "No space left on device"))

    monkeypatch.setattr(measure_device, "sweep", full)
    out = tmp_path / "p.json"
    assert measure_device.main(["--device", "cpu", "--ranks", "0", "--out", str(out)]) == 1
    assert _one_line(capsys) == f"could not write {out.resolve()}: No space left on device"
