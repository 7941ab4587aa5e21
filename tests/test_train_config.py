"""The pipeflow-train config: it composes, and every impossible combination stops in
prepare_training, before any rank is spawned, with one sentence that names the key.

Nothing here trains: the checks run in-process on composed configs, and the app is
started as a user would only with configs that must be refused (or, for the logger
labels, with a stand-in for Hydra's own config).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException
from hydra.types import RunMode
from omegaconf import OmegaConf

from pipeflow.config import CONF_DIR, ConfigError, check_group_choices, compose, prepare_training, runtime_schedules
from pipeflow.schedules.registry import schedule_names
from pipeflow.config.to_runplan import run_record
from pipeflow.train import format_summary
from pipeflow.tracking.labels import logger_labels


def train_cfg(*overrides: str):
    return compose("train", overrides)


def prepare(*overrides: str):
    return prepare_training(train_cfg(*overrides))


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


@pytest.fixture
def no_wandb_credentials(tmp_path, monkeypatch):
    for key in list(os.environ):
        if key.startswith("WANDB_"):
            monkeypatch.delenv(key)
    monkeypatch.delenv("NETRC", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "home" / "config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "home" / "cache"))
    monkeypatch.setenv("WANDB_SILENT", "true")


# ----------------------------------------------------------------------------- composes


@pytest.mark.parametrize("model,data", [("gpt", "text_corpus"), ("bert", "mlm_corpus"), ("cbm", "image_text"),
                                        ("gpt_small", "text_corpus"), ("bert_tiny", "mlm_corpus")])
def test_auto_data_follows_the_model_family_and_keeps_overrides(model, data, tmp_path):
    cfg = train_cfg(f"model={model}", "pipeline.stages=2")
    cfg = prepare_training(cfg).config
    assert cfg.data.name == data and cfg.data.val_fraction > 0  # the data set's own defaults
    (tmp_path / "a.txt").write_text("some text " * 300)  # two windows of gpt_small's 1024 + 1 bytes
    if data != "image_text":
        cfg = train_cfg(f"model={model}", f"data.files=[{tmp_path / 'a.txt'}]", "data.val_fraction=0.5")
        cfg = prepare_training(cfg).config
        assert cfg.data.name == data and cfg.data.val_fraction == 0.5 and len(cfg.data.files) == 1


def test_embedded_defaults():
    cfg = train_cfg()
    assert (cfg.model.name, cfg.schedule.name, cfg.partition.name, cfg.topology.name) == (
        "gpt_tiny", "1f1b", "uniform", "local_cpu")
    assert (cfg.data.name, cfg.optim.name, cfg.runtime.name, cfg.logger.name) == (
        "auto", "adamw", "local", "wandb")
    p = cfg.pipeline
    assert (p.stages, p.microbatches, p.virtual_stages, p.segments, p.microbatch_size) == (2, 4, 1, 1, 4)
    t = cfg.trainer
    assert (t.steps, t.log_every, t.val_every, t.val_batches, t.save_every, t.timeline_step) == (300, 1, 50, 4, 0, 5)
    assert cfg.resume is None and cfg.seed == 1234
    assert cfg.logger.mode == "auto" and cfg.runtime.backend == "auto" and cfg.runtime.timeout_s == 60
    o = cfg.optim
    assert (o.weight_decay, o.beta1, o.beta2, o.eps) == (0.1, 0.9, 0.95, 1e-8)
    assert (o.warmup_steps, o.min_lr_ratio, o.grad_clip) == (20, 0.1, 1.0)

    inputs = prepare_training(cfg)
    assert inputs.world_size == 2 == inputs.schedule.num_devices
    assert inputs.schedule.name == "1f1b" and inputs.topology.num_devices == 2


def test_the_runtime_schedules_are_registered_ones():
    assert set(runtime_schedules()) <= set(schedule_names())
    assert {"1f1b", "zb_h1", "bapp", "planned"} <= set(runtime_schedules())


def test_a_schedule_the_runtime_does_not_run_is_refused(monkeypatch):
    import dataclasses

    from pipeflow.schedules import registry

    spec = registry.get_spec("zb_h1")
    monkeypatch.setitem(registry._SPECS, "zb_h1", dataclasses.replace(spec, runtime=False))
    with pytest.raises(ConfigError, match=r"^schedule\.name=zb_h1: the runtime does not .*values: gpipe, 1f1b, "):
        prepare("schedule=zb_h1")


@pytest.mark.parametrize(
    "overrides,world_size,num_stages",
    [
        (["schedule=gpipe"], 2, 2),
        (["schedule=zb_h1", "pipeline.stages=4", "pipeline.microbatches=8"], 4, 4),
        (["schedule=chimera", "pipeline.stages=4"], 4, 4),
        (["schedule=interleaved_1f1b", "pipeline.virtual_stages=2"], 2, 4),
        (["pipeline.stages=1"], 1, 1),  # the single-process reference
        (["schedule=gpipe", "pipeline.stages=1", "pipeline.microbatches=1"], 1, 1),
    ],
)
def test_runnable_configs_pass(overrides, world_size, num_stages):
    inputs = prepare(*overrides)
    assert inputs.world_size == world_size and inputs.schedule.num_stages == num_stages


@pytest.mark.parametrize("group", ["partition", "optim", "runtime", "logger", "data"])
def test_every_option_composes_and_passes(group, no_wandb_credentials):
    for option in options(group):
        # a data set goes with the model family that trains on it (BERT on masked text)
        # ... and the planner's cut with the plan's schedule
        model = {("data", "mlm_corpus"): ["model=bert_tiny"], ("data", "image_text"): ["model=cbm_tiny"],
                 ("partition", "planner"): ["schedule=planned"]}.get((group, option), [])
        cfg = train_cfg(f"{group}={option}", *model)
        assert cfg[group].name == option
        prepare_training(cfg)


def test_logger_none_has_only_a_name():
    assert OmegaConf.to_container(train_cfg("logger=none").logger) == {"name": "none"}


@pytest.mark.parametrize(
    "override",
    ["trainer.step=3", "optim.learning_rate=1e-3", "runtime.backnd=gloo", "logger.mod=offline", "pipeline.stage=2",
     "seeds=1", "trainer.steps=many"],
)
def test_misspelt_keys_and_wrong_types_fail_at_composition(override):
    with pytest.raises(ConfigCompositionException):
        train_cfg(override)


def test_data_files_that_exist_pass(tmp_path):
    (tmp_path / "a.txt").write_text("hello " * 50)  # each enough for a training and a validation window
    (tmp_path / "b.txt").write_text("world " * 50)
    assert prepare(f"data.files=[{tmp_path / 'a.txt'}]").plan.data["files"] == [str(tmp_path / "a.txt")]
    assert prepare(f"data.files={tmp_path / 'b.txt'}").plan.data["files"] == [str(tmp_path / "b.txt")]
    assert prepare(f"data.files=[{tmp_path / '*.txt'}]").plan.data["files"] == [str(tmp_path / n) for n in ("a.txt", "b.txt")]


def fake_checkpoint(run_dir, step: int = 10, stages: int = 2, sizes=(100, 120), chunk_start=None,
                    movable: bool = False) -> None:
    """A checkpoint folder as pipeflow-train writes it: rank files, meta.json (the step,
    the pipeline it was written for, each file's size), and latest."""
    folder = run_dir / "checkpoints" / f"step_{step:07d}"
    folder.mkdir(parents=True)
    for r, size in enumerate(sizes):
        (folder / f"rank{r}.pt").write_bytes(b"x" * size)
    meta = {"schedule": "1f1b", "stages": stages, "world_size": stages,
            "placement": [list(range(stages))]}
    (folder / "meta.json").write_text(json.dumps({
        "step": step, "chunk_start": step if chunk_start is None else chunk_start, "world_size": len(sizes),
        "meta": meta, "files": {f"rank{r}.pt": size for r, size in enumerate(sizes)},
        **({"format": 2} if movable else {})}))
    (run_dir / "checkpoints" / "latest").write_text(f"{step}\n")  # written once every rank has saved


def test_resume_from_a_run_with_checkpoints_passes(tmp_path):
    fake_checkpoint(tmp_path)
    step = tmp_path / "checkpoints" / "step_0000010"
    assert prepare(f"resume={tmp_path}").plan.resume == str(tmp_path)  # the run: its latest is read by the ranks
    assert prepare(f"resume={step}").plan.resume == str(step)  # or one checkpoint of it


def test_resume_from_a_cut_short_checkpoint_is_refused_before_any_rank(tmp_path):
    """Issue 16, item 5: a truncated rank file is found by its recorded size."""
    fake_checkpoint(tmp_path)
    rank1 = tmp_path / "checkpoints" / "step_0000010" / "rank1.pt"
    rank1.write_bytes(b"x" * 50)
    with pytest.raises(ConfigError, match=rf"^resume=.*: {rank1} has 50 bytes where 120 were written"):
        prepare(f"resume={tmp_path}")
    rank1.unlink()
    with pytest.raises(ConfigError, match=rf"^resume=.*: {rank1} is missing; the checkpoint is incomplete"):
        prepare(f"resume={tmp_path}")


def test_resume_from_a_checkpoint_without_its_record_is_refused(tmp_path):
    fake_checkpoint(tmp_path)
    (tmp_path / "checkpoints" / "step_0000010" / "meta.json").unlink()  # the run stopped while saving
    with pytest.raises(ConfigError, match=r"^resume=.*step_0000010 is incomplete \(no meta.json"):
        prepare(f"resume={tmp_path}")


def test_resume_with_another_number_of_stages_is_refused(tmp_path):
    fake_checkpoint(tmp_path, stages=4, sizes=(10, 10, 10, 10))
    with pytest.raises(ConfigError, match=r"^resume=.*written with stages=4, this run has stages=2"):
        prepare(f"resume={tmp_path}", "pipeline.stages=2")
    prepare(f"resume={tmp_path}", "pipeline.stages=4")


def test_resume_of_a_checkpoint_saved_by_name_takes_another_layout(tmp_path):
    """Issue 60: a checkpoint of parameters by name (format 2) loads into any layout of
    its model; only the model's shape is asked."""
    fake_checkpoint(tmp_path, stages=4, sizes=(10, 10, 10, 10), movable=True)
    two = prepare(f"resume={tmp_path}", "pipeline.stages=2").plan
    assert (two.stages, two.tensor_parallel, two.resume is not None) == (2, 1, True)
    assert prepare(f"resume={tmp_path}", "pipeline.stages=2", "pipeline.tensor_parallel=2").plan.tensor_parallel == 2
    assert prepare(f"resume={tmp_path}", "schedule=zb_v", "pipeline.virtual_stages=2").plan.schedule.name == "zb_v"


def test_resume_at_or_past_the_last_step_is_refused(tmp_path):
    """Issue 60: resumed at step 10 with trainer.steps=10, a run trained nothing and said
    it had written metrics.jsonl."""
    fake_checkpoint(tmp_path, step=10)
    for steps in (10, 2):
        with pytest.raises(ConfigError, match=rf"^trainer.steps={steps}: the checkpoint resume=.* is at step 10, so "
                                              rf"nothing is left to train; give trainer.steps above 10"):
            prepare(f"resume={tmp_path}", f"trainer.steps={steps}")


def test_resume_from_a_run_that_ended_inside_a_chunk_needs_the_chunk_start(tmp_path):
    """An asynchronous run that ended inside a chunk is resumed from the chunk's start:
    that checkpoint must be whole too."""
    fake_checkpoint(tmp_path, step=10, chunk_start=8)
    with pytest.raises(ConfigError, match=r"^resume=.*ended inside a chunk.*step_0000008 is missing"):
        prepare(f"resume={tmp_path}")
    fake_checkpoint(tmp_path, step=8)
    (tmp_path / "checkpoints" / "latest").write_text("10\n")
    prepare(f"resume={tmp_path}")


# --------------------------------------------------------------------------- refused


@pytest.mark.parametrize(
    "overrides,key",
    [
        # the list: more stages than layers, Chimera on odd stages, an unknown
        # schedule (interleaving with m not a multiple of p runs since issue 17)
        (["pipeline.stages=8"], "pipeline.stages=8"),  # gpt_tiny has 4 layers
        (["schedule=interleaved_1f1b", "pipeline.virtual_stages=4"], "pipeline.stages=2"),  # 8 stages > 4 layers
        (["schedule=chimera", "pipeline.stages=3"], "pipeline.stages=3"),
        (["schedule=chimera", "pipeline.stages=1"], "pipeline.stages=1"),
        (["schedule=chimera", "pipeline.microbatches=3"], "pipeline.microbatches=3"),
        (["schedule.name=nope"], "schedule.name=nope"),
        (["schedule=1f1b", "pipeline.virtual_stages=2"], "pipeline.virtual_stages=2"),
        (["pipeline.microbatch_size=0"], "pipeline.microbatch_size=0"),
        # model and topology
        (["model.seq_len=512"], "model.seq_len=512"),  # > model.n_positions=256
        (["model.family=t5"], "model.family=t5"),
        (["model=bert_large", "pipeline.stages=2", "data=text_corpus"], "data.name=text_corpus"),  # BERT needs masked data
        (["model=bert_tiny", "data=text_corpus"], "data.name=text_corpus"),
        (["model=cbm", "data.max_bytes=1000"], "data.max_bytes=1000"),  # image_text has no such key
        (["data=mlm_corpus"], "data.name=mlm_corpus"),  # GPT needs next-token text
        (["model=bert_tiny", "data=mlm_corpus", "model.vocab_size=256"], "model.vocab_size=256"),  # + [MASK] etc.
        (["model.vocab_size=100"], "model.vocab_size=100"),  # bytes need 256
        (["model.dropout=1.0"], "model.dropout=1.0"),
        (["model.vocab_multiple=0"], "model.vocab_multiple=0"),
        (["runtime.sync_check=true", "runtime.device=cpu"], "runtime.sync_check=true"),
        (["topology.num_devices=1"], "topology.num_devices=1"),
        (["partition.name=greedy"], "partition.name=greedy"),
        # trainer
        (["trainer.steps=0"], "trainer.steps=0"),
        (["trainer.save_every=-1"], "trainer.save_every=-1"),
        (["trainer.log_every=0"], "trainer.log_every=0"),
        (["trainer.val_batches=0"], "trainer.val_batches=0"),
        (["trainer.timeline_step=0"], "trainer.timeline_step=0"),
        # optimizer
        (["optim.name=sgd"], "optim.name=sgd"),
        (["optim.lr=0"], "optim.lr=0"),
        (["optim.beta1=-0.1"], "optim.beta1=-0.1"),
        (["optim.beta2=1.0"], "optim.beta2=1.0"),
        (["optim.warmup_steps=-5"], "optim.warmup_steps=-5"),
        (["optim.grad_clip=-1"], "optim.grad_clip=-1"),
        (["optim.min_lr_ratio=2"], "optim.min_lr_ratio=2"),
        (["optim.eps=0"], "optim.eps=0"),
        (["optim.impl=apex"], "optim.impl=apex"),
        # runtime
        (["runtime.backend=mpi"], "runtime.backend=mpi"),
        (["runtime.device=tpu"], "runtime.device=tpu"),
        (["runtime.backend=nccl", "runtime.device=cpu"], "runtime.backend=nccl"),
        (["runtime.timeout_s=0"], "runtime.timeout_s=0"),
        (["runtime.master_port=70000"], "runtime.master_port=70000"),
        (["runtime.threads_per_rank=0"], "runtime.threads_per_rank=0"),
        (["runtime.trace_steps=-1"], "runtime.trace_steps=-1"),
        (["runtime.fail_rank=2", "runtime.fail_at_step=3"], "runtime.fail_rank=2"),  # 2 ranks: 0 and 1
        (["runtime.fail_rank=1"], "runtime.fail_at_step=null"),
        (["runtime.fail_rank=1", "runtime.fail_at_step=2", "runtime.fail_mode=explode"], "runtime.fail_mode=explode"),
        # logger
        (["logger.mode=sometimes"], "logger.mode=sometimes"),
        (["logger=none", "logger.name=tensorboard"], "logger.name=tensorboard"),
    ],
)
def test_bad_configs_fail_with_one_sentence_naming_the_key(overrides, key):
    with pytest.raises(ConfigError) as info:
        prepare(*overrides)
    msg = str(info.value)
    assert key in msg
    assert "\n" not in msg, msg


def test_byte_vocabulary_matches_the_data_set():
    from pipeflow.config import BYTE_VOCAB
    from pipeflow.data.text import ByteTokenizer

    assert BYTE_VOCAB == ByteTokenizer.vocab_size


def test_mlm_vocabulary_matches_the_data_set():
    from pipeflow.config import MLM_VOCAB
    from pipeflow.data.mlm import MLM_VOCAB as DATA_MLM_VOCAB
    from pipeflow.data.mlm import SEP_ID

    assert MLM_VOCAB == DATA_MLM_VOCAB == SEP_ID + 1
    assert compose("train", ["model=bert_tiny"]).model.vocab_size >= MLM_VOCAB


def test_bert_with_masked_data_passes():
    assert prepare("model=bert_tiny", "data=mlm_corpus").plan.data["name"] == "mlm_corpus"
    plan = prepare("model=bert_tiny", "data=mlm_corpus", "schedule=chimera", "pipeline.stages=4").plan
    assert (plan.data["name"], plan.schedule.name, plan.layers_per_stage) == ("mlm_corpus", "chimera", [1, 1, 1, 1])


def test_unknown_schedule_lists_the_allowed_values():
    with pytest.raises(ConfigError, match="allowed values: gpipe, 1f1b, interleaved_1f1b, zb_h1, chimera"):
        prepare("schedule.name=nope")


def test_chimera_on_one_stage_points_to_the_reference_schedule():
    with pytest.raises(ConfigError, match=r"use schedule=1f1b"):
        prepare("schedule=chimera", "pipeline.stages=1")


def test_more_stages_than_layers_says_the_allowed_range():
    with pytest.raises(ConfigError, match=r"only 4 layers .*allowed values: 1\.\.4"):
        prepare("pipeline.stages=5")


def test_unknown_partition_lists_the_allowed_values():
    with pytest.raises(ConfigError, match="allowed values: uniform, parameters"):
        prepare("partition.name=greedy")


@pytest.mark.parametrize("files", ["[{d}/missing.txt]", "{d}/missing.txt", "[{d}/*.nothing]"])
def test_missing_data_files(tmp_path, files):
    (tmp_path / "real.txt").write_text("x")
    with pytest.raises(ConfigError) as info:
        prepare("data.files=" + files.format(d=tmp_path))
    msg = str(info.value)
    assert msg.startswith("data.files=") and ("missing.txt: no such file" in msg or "*.nothing: no file matches" in msg)


def test_one_missing_file_among_several_is_named(tmp_path):
    (tmp_path / "real.txt").write_text("x")
    with pytest.raises(ConfigError, match=r"data\.files=.*gone\.txt: no such file"):
        prepare(f"data.files=[{tmp_path / 'real.txt'},{tmp_path / 'gone.txt'}]")


def test_resume_from_a_missing_dir(tmp_path):
    with pytest.raises(ConfigError, match=r"^resume=.*no such directory"):
        prepare(f"resume={tmp_path / 'nowhere'}")


def test_resume_from_a_dir_without_checkpoints(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ConfigError, match=r"^resume=.*checkpoints/"):
        prepare(f"resume={tmp_path}")
    (tmp_path / "checkpoints" / "step_0000005").mkdir(parents=True)  # a save that never finished
    with pytest.raises(ConfigError, match=r"^resume=.*checkpoints/latest is missing"):
        prepare(f"resume={tmp_path}")


def test_cuda_requested_where_there_is_none():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ConfigError, match=r"^runtime\.device=cuda: no CUDA device"):
        prepare("runtime.device=cuda")


def test_online_without_credentials_fails_before_start(no_wandb_credentials):
    with pytest.raises(ConfigError, match=r"^logger\.mode=online: no W&B API key .*wandb login"):
        prepare("logger.mode=online")


def test_online_with_an_api_key_passes(no_wandb_credentials, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "0123456789" * 4)  # never verified: no network
    assert prepare("logger.mode=online").plan.logger.mode == "online"


@pytest.mark.parametrize(
    "args,message",
    [
        (["schedule=nope"],
         "schedule=nope: unknown schedule; allowed values: 1f1b, amdp, bapp, chimera, dualpipe_v, file, gpipe, interleaved_1f1b, interleaved_zb, looped_bfs, pipedream, pipedream_2bw, planned, seq1f1b, seq1f1b_interleaved, zb_h1, zb_h2, zb_v"),
        (["-m", "schedule=gpipe,nope,1f1b"], "schedule=nope: unknown schedule"),
        (["trainer.steps=3", "model=gpt_huge"], "model=gpt_huge: unknown model; allowed values: bert, bert_1b, "),
        (["logger=tensorboard"], "logger=tensorboard: unknown logger; allowed values: none, wandb"),
    ],
)
def test_unknown_group_options_on_the_command_line(args, message):
    with pytest.raises(ConfigError) as info:
        check_group_choices(args)
    assert str(info.value).startswith(message)


@pytest.mark.parametrize(
    "args",
    [
        [], ["--help"], ["-m", "schedule=gpipe,1f1b,chimera", "trainer.steps=20"], ["model=gpt_small", "logger=none"],
        ["+extra=1", "~logger"], ["trainer.steps=nope"],  # not group choices: Hydra's and the schema's business
        ["--config-dir", "sweeps", "schedule=mine"], ["hydra.searchpath=[file:///x]", "schedule=mine"],  # elsewhere
        ["schedule=gpipe,"],  # malformed: Hydra reports it
    ],
)
def test_group_choices_left_to_hydra(args):
    try:
        check_group_choices(args)
    except ConfigError as err:
        pytest.fail(f"{args} refused before Hydra: {err}")


# ------------------------------------------------------------------ what the app adds


def hydra_stub(mode: RunMode, overrides=(), output_dir="outputs/train/2026-11-21/12-00-00",
               sweep_dir="outputs/multirun/train/2026-11-21/12-00-00"):
    cfg = OmegaConf.create({
        "sweep": {"dir": sweep_dir},
        "job": {"name": "train"},
        "overrides": {"task": list(overrides)},
        "runtime": {"output_dir": output_dir},
    })
    cfg.mode = mode
    return cfg


def test_single_run_labels_come_from_the_config():
    cfg = train_cfg("logger.group=mine", "logger.tags=[a,b]", "schedule=gpipe")
    labels = logger_labels(cfg.logger, hydra_stub(RunMode.RUN, ["logger.group=mine", "schedule=gpipe"]))
    assert labels == {"group": "mine", "tags": ["a", "b"], "run_name": None}
    assert logger_labels(train_cfg().logger, hydra_stub(RunMode.RUN)) == {"group": None, "tags": [], "run_name": None}


def test_multirun_jobs_share_a_group_and_are_tagged_with_their_overrides():
    overrides = ["schedule=gpipe", "trainer.steps=20", "logger.mode=offline", "+x=" + "y" * 80]
    stub = hydra_stub(RunMode.MULTIRUN, overrides,
                      output_dir="outputs/multirun/train/2026-11-21/12-00-00/0_schedule=gpipe,trainer.steps=20")
    labels = logger_labels(train_cfg("logger.tags=[mine]").logger, stub)
    assert labels["group"] == "train-2026-11-21_12-00-00"
    assert labels["tags"] == ["mine", "schedule=gpipe", "trainer.steps=20", ("+x=" + "y" * 80)[:64]]
    assert labels["run_name"] == "0_schedule=gpipe,trainer.steps=20"


def test_multirun_keeps_an_explicit_group_and_name():
    stub = hydra_stub(RunMode.MULTIRUN, ["schedule=gpipe"], sweep_dir="/tmp/sweeps/mine",
                      output_dir="/tmp/sweeps/mine/0")
    labels = logger_labels(train_cfg("logger.group=paper", "logger.run_name=r").logger, stub)
    assert (labels["group"], labels["run_name"]) == ("paper", "r")
    assert logger_labels(train_cfg().logger, stub)["group"] == "train-mine"


def test_the_run_record_is_plain_resolved_and_labelled(tmp_path, monkeypatch):
    (tmp_path / "old" / "checkpoints" / "step_1").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    cfg = train_cfg("resume=old")
    plain = run_record(cfg, hydra_stub(RunMode.MULTIRUN, ["resume=old"], output_dir="x/3_resume=old"))
    assert isinstance(plain, dict) and isinstance(plain["logger"]["tags"], list)
    assert plain["resume"] == str(tmp_path / "old")
    assert plain["logger"]["run_name"] == "3_resume=old" and plain["logger"]["tags"] == ["resume=old"]
    assert plain["model"] == OmegaConf.to_container(cfg.model)
    assert run_record(train_cfg("logger=none"), hydra_stub(RunMode.MULTIRUN))["logger"] == {"name": "none"}
    assert run_record(cfg, hydra_stub(RunMode.RUN))["data"]["files"] is None  # the default corpus


def test_a_multiruns_labels_reach_the_ranks_typed_logger_settings():
    """The plan's logger settings (what rank 0's W&B run reads) carry the labels its record shows."""
    plan = prepare_training(train_cfg("logger=wandb"), hydra_stub(RunMode.MULTIRUN, ["trainer.steps=2"],
                                                                   output_dir="x/3_steps")).plan
    assert (plan.logger.run_name, plan.logger.tags, plan.logger.group) == ("3_steps", ["trainer.steps=2"],
                                                                           "train-2026-11-21_12-00-00")
    assert plan.record["logger"]["run_name"] == "3_steps" and plan.trainer.steps == plan.record["trainer"]["steps"]


def test_the_run_record_lists_the_data_files_its_globs_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes").mkdir()
    for name in ("b.txt", "a.txt", "c.md"):
        (tmp_path / "notes" / name).write_text(name)
    (tmp_path / "one.txt").write_text("1")
    files = run_record(train_cfg("data.files=[one.txt,notes/*.txt]"), hydra_stub(RunMode.RUN))["data"]["files"]
    assert files == [str(tmp_path / "one.txt"), str(tmp_path / "notes" / "a.txt"), str(tmp_path / "notes" / "b.txt")]
    assert run_record(train_cfg("data.files=one.txt"), hydra_stub(RunMode.RUN))["data"]["files"] == [
        str(tmp_path / "one.txt")]


def test_summary_lines():
    text = format_summary({"schedule": "1f1b", "steps": 3, "final_loss": 2.123456789, "per_device": [1]}, "/r")
    assert text.splitlines()[:3] == ["schedule              1f1b", "steps                 3",
                                     "final_loss            2.12346"]
    assert "per_device" not in text and text.endswith("/r")


# ------------------------------------------------------------------------ as a user would


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HYDRA_", "WANDB_"))}
    return subprocess.run([sys.executable, "-m", "pipeflow.train", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_a_bad_config_stops_the_app_in_one_line(tmp_path):
    run_dir = tmp_path / "run"
    proc = _run(["schedule=nope", f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert proc.returncode == 1
    err = proc.stderr.strip()
    assert err == "schedule=nope: unknown schedule; allowed values: 1f1b, amdp, bapp, chimera, dualpipe_v, file, gpipe, interleaved_1f1b, interleaved_zb, looped_bfs, pipedream, pipedream_2bw, planned, seq1f1b, seq1f1b_interleaved, zb_h1, zb_h2, zb_v"
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert not any(run_dir.glob("*.json*")) and not (run_dir / "wandb").exists()  # no rank ever started


@pytest.mark.slow  # a subprocess or a large search
def test_the_check_does_not_load_torch():
    """Checking a config imports neither torch nor wandb nor datasets, so a bad one is refused at once."""
    code = ("import sys; from pipeflow.config import compose, prepare_training; import pipeflow.train; "
            "prepare_training(compose('train')); "
            "print(sorted(m for m in ('torch', 'wandb', 'datasets') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


@pytest.mark.slow  # a subprocess or a large search
def test_a_bad_combination_stops_the_app_in_one_line_before_any_rank(tmp_path):
    run_dir = tmp_path / "run"
    proc = _run(["schedule=chimera", "pipeline.stages=3", "logger=none", f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert proc.returncode == 1
    err = proc.stderr.strip()
    assert err.startswith("pipeline.stages=3: schedule 'chimera' needs an even number of stages")
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "summary.json").exists()


@pytest.mark.slow  # a subprocess or a large search
def test_a_bad_multirun_job_does_not_stop_the_others(tmp_path):
    sweep = tmp_path / "multi"
    proc = _run(["-m", "schedule.name=nope,chimera", "pipeline.stages=3", f"hydra.sweep.dir={sweep}"], cwd=tmp_path)
    assert proc.returncode != 0
    assert "schedule.name=nope: unknown schedule" in proc.stderr
    assert "pipeline.stages=3: schedule 'chimera' needs an even number of stages" in proc.stderr  # the 2nd job ran
    assert "Traceback" not in proc.stderr
    assert not list(sweep.glob("*/metrics.jsonl"))


@pytest.mark.parametrize(
    "rows,message",
    [
        ([{"image": [[0.0] * 8] * 8, "caption": "a digit"}] * 4, "no 'text' column"),
        ([{"text": "a digit"}] * 4, "no 'image' column"),
        ([{"image": [[0.0] * 8] * 8, "text": "a"}, {"image": [[0.0] * 4] * 4, "text": "b"}] * 2, "inconsistent sizes"),
    ],
)
def test_bad_image_text_files_stop_before_any_rank(rows, message, tmp_path):
    path = tmp_path / "pairs.json"
    path.write_text(json.dumps(rows))
    with pytest.raises(ConfigError) as e:
        prepare_training(train_cfg("model=cbm", f"data.files=[{path}]"))
    assert str(e.value).startswith("data.files") and message in str(e.value)


@pytest.mark.parametrize("model", ["gpt", "bert", "cbm"])
def test_an_empty_file_list_stops_before_any_rank(model):
    with pytest.raises(ConfigError, match=r"^data.files=\[\]: the list is empty"):
        prepare_training(train_cfg(f"model={model}", "data.files=[]"))


@pytest.mark.parametrize(
    "args,message",
    [
        (["schedule=amdp", "pipeline.stages=3"], r"^pipeline\.stages=3: schedule 'amdp' needs an even pipeline depth"),
        (["schedule=amdp", "pipeline.stages=4", "pipeline.microbatches=6"],
         r"^pipeline\.microbatches=6: schedule 'amdp' needs a multiple of pipeline\.stages=4"),
        (["schedule=amdp", "pipeline.stages=4", "pipeline.microbatches=8", "schedule.accumulation_rounds=4"],
         r"^pipeline\.microbatches=8: schedule 'amdp' needs schedule\.accumulation_rounds=4 rounds .*16"),
        (["schedule=pipedream_2bw", "pipeline.stages=4", "pipeline.microbatches=2"],
         r"^pipeline\.microbatches=2: schedule 'pipedream_2bw' needs at least as many microbatches"),
        (["schedule=1f1b", "+schedule.windows=4"], r"^schedule\.windows=4: schedule '1f1b' has no option 'windows'"),
        (["schedule=pipedream", "schedule.windows=0"], r"^schedule\.windows=0: schedule 'pipedream' needs a whole number"),
    ],
)
def test_asynchronous_schedule_options_are_checked_before_start(args, message):
    with pytest.raises(ConfigError, match=message):
        prepare(*args)


@pytest.mark.parametrize(
    "override,message",
    [
        ("+trainer.precision=bf16", r"^trainer\.precision=bf16: unknown key; trainer has steps, log_every, "),
        ("++trainer.stepz=5", r"^trainer\.stepz=5: unknown key; trainer has steps, "),
        ("+pipeline.expert_parallel=2", r"^pipeline\.expert_parallel=2: unknown key; pipeline has stages, microbatches, "),
        ("+runtime.dtype=bf16", r"^runtime\.dtype=bf16: unknown key; runtime has name, backend, "),
        ("+foo=1", r"^foo=1: unknown key; the config has pipeline, schedule, "),
    ],
)
def test_a_forced_key_no_schema_has_is_refused(override, message):
    """Hydra adds a key forced with + or ++ to a typed group without complaint; nothing
    would read it, so the check refuses it, naming the key and the group's keys."""
    with pytest.raises(ConfigError, match=message):
        prepare("trainer.steps=5", override)


def test_a_key_that_moved_is_refused_with_its_new_spelling():
    """runtime.precision became the top-level precision every app shares (issue 31): an
    old command line is refused before Hydra composes, and the sentence gives the new one."""
    from pipeflow.config import check_overrides

    with pytest.raises(ConfigError, match=r"^runtime\.precision=bf16: unknown key; runtime has .*"
                                          r"\(it moved: precision=bf16\)$"):
        check_overrides("train", ["runtime.precision=bf16", "logger=none"])
    check_overrides("train", ["precision=bf16", "logger=none"])  # the new spelling composes


@pytest.mark.parametrize("override,key", [("+pipeline.expert_parallel=2", "pipeline.expert_parallel=2"),
                                          ("++cost.efficiency_typo=0.5", "cost.efficiency_typo=0.5"),
                                          ("+foo=1", "foo=1")])
def test_simulate_refuses_a_forced_unknown_key(override, key):
    from pipeflow.config import prepare_simulation

    with pytest.raises(ConfigError, match=rf"^{re.escape(key)}: unknown key; "):
        prepare_simulation(compose("simulate", [override]))


@pytest.mark.slow  # a subprocess
def test_a_forced_unknown_key_stops_the_app_in_one_line(tmp_path):
    run_dir = tmp_path / "run"
    proc = _run(["+trainer.precision=bf16", "trainer.steps=5", "logger=none", f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert proc.returncode == 1
    err = proc.stderr.strip()
    assert err.startswith("trainer.precision=bf16: unknown key; trainer has steps,") and len(err.splitlines()) == 1
    assert not (run_dir / "metrics.jsonl").exists()


def _text_file(tmp_path: Path, name: str, content: bytes) -> str:
    path = tmp_path / name
    path.write_bytes(content)
    return str(path)


@pytest.mark.parametrize(
    "make,extra,message",
    [
        (lambda d: _text_file(d, "empty.txt", b""), [], r"^data\.files: .*empty\.txt is empty; list files that hold text$"),
        (lambda d: _text_file(d, "blob.bin", bytes(range(256)) * 64), [],
         r"^data\.files: .*blob\.bin is not UTF-8 text \(byte 128 cannot be decoded\); list text files$"),
        (lambda d: _text_file(d, "latin1.txt", "caf\u00e9 ".encode("latin-1") * 200), [],
         r"^data\.files: .*latin1\.txt is not UTF-8 text"),
        (lambda d: _text_file(d, "short.txt", b"too short"), [],
         r"^data\.files=.*short\.txt: too little text, about 10 bytes for windows of seq_len\+1=129 bytes"),
        (None, ["data.max_bytes=10"], r"^data\.max_bytes=10: too little text, about 10 bytes .*give at least 258 bytes$"),
        (None, ["data.val_fraction=1.5"], r"^data\.val_fraction=1\.5: the held-out share of the text"),
        (None, ["data.max_bytes=0"], r"^data\.max_bytes=0: must be a whole number >= 1$"),
    ],
)
def test_data_that_would_fail_in_the_ranks_is_refused_up_front(tmp_path, make, extra, message):
    """What the ranks used to find 20-36 s after starting (issue 16, item 5), in one sentence
    naming the key and the file, before any rank starts: real files, the default model."""
    files = [f"data.files={make(tmp_path)}"] if make else []
    with pytest.raises(ConfigError, match=message):
        prepare(*files, *extra)


def test_enough_utf8_text_passes_and_a_character_cut_by_max_bytes_is_fine(tmp_path):
    path = _text_file(tmp_path, "ok.txt", ("\u00e9t\u00e9 " * 400).encode("utf-8"))
    assert prepare(f"data.files={path}").plan.data["files"] == [str(path)]
    cut = prepare(f"data.files={path}", "data.max_bytes=301").plan.data  # ends inside a two-byte character
    assert (cut["files"], cut["max_bytes"]) == ([str(path)], 301)


def test_prepare_training_leaves_its_config_alone_and_returns_the_resolved_one():
    """A model preset's shape, data=auto and precision=auto are resolved in a copy (the
    inputs' config, what the job's config is made of); the config given is as it was."""
    cfg = compose("train", ["model=llama_tiny", "pipeline.stages=2"])
    before = OmegaConf.to_yaml(cfg)
    inputs = prepare_training(cfg)
    assert OmegaConf.to_yaml(cfg) == before
    assert (cfg.data.name, cfg.precision) == ("auto", "auto")
    resolved = inputs.config
    assert resolved.data.name != "auto" and resolved.precision == inputs.plan.precision == "fp32"
    assert resolved.model.n_layer == sum(inputs.plan.layers_per_stage)
