"""Bad input on the newer surfaces (issue 33), met as a user meets it: the app run as a
subprocess on a real file or value, refused in one sentence that names the key, before
any rank starts, exit status 1, and no run folder left behind."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

slow = pytest.mark.slow  # a subprocess each


# the checkout under test first on the path: the app run from a temporary folder would
# otherwise import whichever checkout the environment's editable install points at
SOURCE = str(Path(__file__).resolve().parents[1])


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HYDRA_", "WANDB_"))}
    env["PYTHONPATH"] = os.pathsep.join([SOURCE, *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


def _app(module: str, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = _env()
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=180)


def _refusal(args: list[str]) -> str:
    """The sentence pipeflow-train's up-front check refuses ``args`` with, in this process
    (prepare_training, as the app calls it first). A group of such cases has one of them
    run through the app itself (:func:`_refused`), which prints the same sentence alone."""
    from pipeflow.config import ConfigError, compose, prepare_training
    from pipeflow.config.command_line import free_form

    with pytest.raises(ConfigError) as err:  # (model.hf.* as the app takes it: any transformers field)
        prepare_training(compose("train", free_form([*args, "logger=none"])))
    return str(err.value)


def _refused(module: str, args: list[str], tmp_path: Path) -> str:
    """The app's one line on stderr, checked: exit 1, nothing on stdout, no run folder."""
    run_dir = tmp_path / "run"
    proc = _app(module, [*args, "logger=none", f"hydra.run.dir={run_dir}"], tmp_path)
    err = proc.stderr.strip()
    assert proc.returncode == 1, (proc.returncode, proc.stdout[-2000:], err[-2000:])
    assert len(err.splitlines()) == 1 and "Traceback" not in err and proc.stdout.strip() == "", err[-2000:]
    assert not run_dir.exists(), sorted(p.name for p in run_dir.iterdir())
    return err


SCHEDULE_FILES = {  # one device a line, pipeflow's notation; 2 stages, 2 microbatches
    "no backward": ("0F0,0F1\n1F0,1F1\n", "missing actions: 0B0, 1B0, 0B1, 1B1"),
    "a deadlock": ("0F0,0B0,0F1,0B1\n1F1,1B1,1F0,1B0\n", "deadlocks after 1 of 10 actions: device 0 at 0B0"),
    "an action twice": ("0F0,0F0,0B0,0F1,0B1\n1F0,1B0,1F1,1B1\n", "actions scheduled more than once: 0F0"),
    "W before I": ("0F0,0F1,0W0,0I0,0I1,0W1\n1F0,1I0,1W0,1F1,1I1,1W1\n",
                   "device 0 at 0W0 (position 2) waits for 0I0, which comes later on the same device"),
    "not UTF-8": ("0F0,0B0,0F1,0B1\n1F0,1B0,1F1,1B1 # caf\xe9\n".encode("latin-1"),
                  "not UTF-8 text (byte 37 is 0xe9); save it as UTF-8"),
}


@slow
@pytest.mark.parametrize("case", list(SCHEDULE_FILES))
def test_a_schedule_file_that_cannot_run_is_refused_naming_the_file(case, tmp_path):
    text, sentence = SCHEDULE_FILES[case]
    path = tmp_path / "mine.csv"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    err = _refused("pipeflow.train", ["schedule=file", f"schedule.path={path}", "pipeline.microbatches=2",
                                      "trainer.steps=2"], tmp_path)
    assert err.startswith(f"schedule.path={path}: ") and sentence in err, err


@slow
def test_the_simulator_refuses_the_same_file_in_the_same_sentence(tmp_path):
    path = tmp_path / "mine.csv"
    path.write_text(SCHEDULE_FILES["no backward"][0])
    err = _refused("pipeflow.simulate", ["schedule=file", f"schedule.path={path}", "pipeline.microbatches=2",
                                         "pipeline.stages=2"], tmp_path)
    assert err == f"schedule.path={path}: missing actions: 0B0, 1B0, 0B1, 1B1"


HF_VALUES = {  # a Hugging Face shape that transformers or a rank would have failed on, or filled in
    "no key/value heads": (["model=llama_tiny", "model.hf.num_key_value_heads=0"],
                           "model.hf.num_key_value_heads=0: must be a whole number of at least 1"),
    "no query heads": (["model=llama_tiny", "model.hf.num_attention_heads=0"],
                       "model.hf.num_attention_heads=0: must be a whole number of at least 1"),
    "heads that do not divide the width": (
        ["model=llama_tiny", "model.hf.num_attention_heads=3", "model.hf.num_key_value_heads=3"],
        "model.hf.num_attention_heads=3: must divide the width 128 (hidden_size), or set model.hf.head_dim"),
    "key/value heads that do not divide the heads": (
        ["model=llama_tiny", "model.hf.num_key_value_heads=3"],
        "model.hf.num_key_value_heads=3: must divide the 4 query heads (num_attention_heads)"),
    "a width in words": (["model=llama_tiny", "model.hf.hidden_size=big"],
                         "model.hf.hidden_size=big: must be a whole number of at least 1"),
    "GPT-2's heads that do not divide its width": (
        ["model=hf_causal", "model.hf.model_type=gpt2", "model.hf.n_embd=128", "model.hf.n_head=3",
         "model.hf.n_layer=4", "model.hf.vocab_size=256", "model.hf.n_positions=256"],
        "model.hf.n_head=3: must divide the width 128 (n_embd), or set model.hf.head_dim"),
}


@pytest.mark.parametrize("case", list(HF_VALUES))
def test_a_hugging_face_shape_that_cannot_build_is_refused_before_any_rank(case):
    args, sentence = HF_VALUES[case]
    assert _refusal([*args, "trainer.steps=2"]) == sentence


@slow
def test_the_app_says_a_hugging_face_refusal_alone(tmp_path):
    args, sentence = HF_VALUES["a width in words"]
    assert _refused("pipeflow.train", [*args, "trainer.steps=2"], tmp_path) == sentence


@slow
def test_a_config_file_without_a_width_is_refused_not_filled_in(tmp_path):
    """transformers fills a missing hidden_size with its preset's (Llama: 4096): the run
    trained a model 32 times wider than the file's, silently."""
    config = {"model_type": "llama", "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
              "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 256}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    err = _refused("pipeflow.train", ["model=hf_causal", f"model.config={path}", "trainer.steps=2"], tmp_path)
    assert err.startswith(f"model.config={path}: gives no hidden_size; set model.hf.hidden_size=<n>"), err


TINY = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 256,
        "tie_word_embeddings": False}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A small Llama's config.json and its weights, as a local model folder holds them."""
    from omegaconf import OmegaConf
    from safetensors.torch import save_file

    from pipeflow.config import compose, prepare_training
    from pipeflow.models import hf_causal

    folder = tmp_path_factory.mktemp("llama")
    (folder / "config.json").write_text(json.dumps(TINY))
    cfg = compose("train", ["model=hf_causal", f"model.config={folder}", "logger=none"])
    model = hf_causal.build_model(OmegaConf.to_container(prepare_training(cfg).config.model, resolve=True), seed=5)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    return folder


def _weights(folder: Path, case: str, tmp_path: Path) -> Path:
    from safetensors.torch import load_file, save_file

    good = folder / "model.safetensors"
    bad = tmp_path / case
    bad.mkdir()
    if case == "garbage":
        (bad / "model.safetensors").write_bytes(b"not a checkpoint\n" * 20)
    elif case == "truncated":
        data = good.read_bytes()
        (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    else:
        tensors = load_file(str(good))
        if case == "a shape":
            tensors["model.layers.0.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"][:64].clone()
        else:  # a layer missing
            tensors = {k: v for k, v in tensors.items() if "layers.3." not in k}
        save_file(tensors, str(bad / "model.safetensors"))
    return bad


WEIGHTS = {
    "garbage": "model.safetensors: not a safetensors file (it does not start with a header's length",
    "truncated": "model.safetensors: cut short: its tensors end at byte",
    "a shape": ": model.layers.0.mlp.up_proj.weight is (64, 64) there, (128, 64) in the model's config",
    "a layer": ": the checkpoint lacks model.layers.3.self_attn.q_proj.weight",
}


@pytest.mark.parametrize("case", list(WEIGHTS))
def test_a_checkpoint_that_does_not_fit_the_model_is_refused_before_any_rank(checkpoint, case, tmp_path):
    """Each was a traceback from inside the ranks, about 11 s in (the shape and the missing
    tensors from one rank only); the files' headers are read up front now (the app's own
    line for one of them: the next test)."""
    bad = _weights(checkpoint, case, tmp_path)
    err = _refusal(["model=hf_causal", f"model.config={checkpoint}", f"model.weights={bad}", "trainer.steps=2"])
    assert err.startswith(f"model.weights={bad}") and WEIGHTS[case] in err, err


@slow
def test_the_app_says_a_checkpoint_refusal_alone(checkpoint, tmp_path):
    bad = _weights(checkpoint, "a shape", tmp_path)
    err = _refused("pipeflow.train", ["model=hf_causal", f"model.config={checkpoint}", f"model.weights={bad}",
                                      "trainer.steps=2"], tmp_path)
    assert err.startswith(f"model.weights={bad}") and WEIGHTS["a shape"] in err, err


def test_model_weights_takes_a_file_or_its_folder_and_names_what_is_neither(checkpoint, tmp_path):
    from pipeflow.config import ConfigError, compose, prepare_training

    def prepare(weights):
        return prepare_training(compose("train", ["model=hf_causal", f"model.config={checkpoint}",
                                                  f"model.weights={weights}", "logger=none"]))

    prepare(checkpoint)
    prepare(checkpoint / "model.safetensors")  # "no *.safetensors files there", before
    for weights, sentence in ((tmp_path / "nowhere", "no such file or folder"),
                              (tmp_path, "no *.safetensors files in that folder"),
                              (checkpoint / "config.json", "not a .safetensors file")):
        with pytest.raises(ConfigError, match="^" + re.escape(f"model.weights={weights}: {sentence}")):
            prepare(weights)


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    """gpt_tiny trained 2 steps at fp32 on 2 ranks: a run to resume (launched in this
    process, as the app launches it; the refusals below go through the app)."""
    import pipeline_runs

    run = tmp_path_factory.mktemp("runs") / "base"
    pipeline_runs.train(run, ["trainer.steps=2", "precision=fp32", "trainer.timeline_step=null", "logger=none"])
    return run


RESUMED = {
    "another model": (["model=llama_tiny"], "this run builds llama_tiny (family gpt there, hf_causal here"),
    "another width": (["model.n_embd=64"], "this run builds gpt_tiny (n_embd 128 there, 64 here)"),
}


@slow
@pytest.mark.parametrize("case", list(RESUMED))
def test_resuming_with_another_model_is_refused_before_any_rank(trained_run, case, tmp_path):
    """It failed inside the ranks, loading the state dict, with dozens of key names."""
    args, sentence = RESUMED[case]
    err = _refused("pipeflow.train", [f"resume={trained_run}", *args, "trainer.steps=3"], tmp_path)
    assert err.startswith(f"resume={trained_run}: the checkpoint holds model gpt_tiny, ") and sentence in err, err
    assert err.endswith("resume with model=gpt_tiny and its shape")


@slow
def test_resuming_with_other_training_settings_says_what_changed(trained_run):
    from pipeflow.config import compose, prepare_training
    from pipeflow.config.groups.resume import resume_changes

    cfg = compose("train", [f"resume={trained_run}", "precision=bf16", "pipeline.microbatch_size=2",
                            "model.vocab_multiple=64", "trainer.steps=3", "logger=none"])
    tables = " (the vocabulary's tables are cut or padded to this run's rows: their padding is zero)"
    assert resume_changes(prepare_training(cfg).config) == [
        f"resuming with {key}={new}, where the checkpoint was written with {key}={old}: its weights and "
        f"optimizer state carry over{then}" for key, new, old, then in (("precision", "bf16", "fp32", ""),
                                                                         ("model.vocab_multiple", 64, 1, tables),
                                                                         ("pipeline.microbatch_size", 2, 4, ""))]


@slow
def test_resuming_with_a_larger_position_table_is_refused_naming_it(trained_run, tmp_path):
    """Longer sequences need a larger learned position table, which the checkpoint's
    table does not load into; it was refused naming n_positions among the shape keys."""
    err = _refused("pipeflow.train", [f"resume={trained_run}", "model.n_positions=512", "model.seq_len=512",
                                      "trainer.steps=3"], tmp_path)
    assert err == (f"resume={trained_run}: the checkpoint's position table holds 256 positions (model.n_positions="
                   f"256), this run's 512, and a table loads only at its own size; resume with model.n_positions=256 "
                   f"and a model.seq_len of at most 256")


@slow
def test_resuming_with_other_sequences_and_data_says_so_and_records_them(trained_run, tmp_path, caplog):
    """The checkpoint recorded neither the sequence length nor the data: a resumed run
    that changed them said nothing. (pipeflow-train's launch of the checked job, in this
    process: its lines are the app's log.)"""
    import logging

    from pipeflow.config import compose, prepare_training
    from pipeflow.train import _train

    run = tmp_path / "resumed"
    over = [f"resume={trained_run}", "model.seq_len=64", "data.max_bytes=1000000", "trainer.steps=3",
            "trainer.timeline_step=null", "logger=none"]
    with caplog.at_level(logging.INFO, logger="pipeflow.train"):
        _train(prepare_training(compose("train", over)), None, str(run))
    said = caplog.text
    assert ("resuming with model.seq_len=64, where the checkpoint was written with model.seq_len=128: its weights "
            "and optimizer state carry over, and each sequence from here on is 64 tokens") in said
    assert ("resuming with data.max_bytes=1000000, where the checkpoint was written with data.max_bytes=3000000: "
            "its weights and optimizer state carry over, and the batches from here on come from this run's data"
            ) in said
    step = (run / "checkpoints" / "latest").read_text().strip()
    meta = json.loads((run / "checkpoints" / f"step_{int(step):07d}" / "meta.json").read_text())["meta"]
    assert meta["training"]["model.seq_len"] == 64 and meta["training"]["data.name"] == "text_corpus"


def test_a_rotary_models_longest_sequence_is_no_weights_shape():
    """Rotary positions (Llama, Qwen2) have no table: raising max_position_embeddings on
    resuming loads the same weights; a learned table (GPT, BERT) does not."""
    from pipeflow.formats.checkpoint_folder import model_difference

    rotary = {"name": "llama_tiny", "family": "hf_causal", "n_embd": 128, "n_positions": 256, "positions": "rotary"}
    assert model_difference(rotary, {**rotary, "n_positions": 1024}) is None
    assert "n_embd 128 there, 64 here" in model_difference(rotary, {**rotary, "n_positions": 1024, "n_embd": 64})
    learned = {"name": "gpt_tiny", "family": "gpt", "n_positions": 256}
    assert model_difference(learned, {**learned, "n_positions": 1024}).startswith(
        "the checkpoint's position table holds 256 positions")


SEARCHES = {
    "no devices": (["search.devices=0"], "search.devices=0: must be a whole number >= 1"),
    "a batch nothing divides": (["search.global_batch=7", "search.stages=[1]"],
                                "search.global_batch=7: no combination of the search's options adds up (the global "
                                "batch does not divide into data_parallel x microbatch_size: "),
    "a binary calibration": (["topology=local_cpu", "search.devices=2", "search.calibration=[{file}]"],
                             "search.calibration={file}: not a calibration file (not UTF-8 text: byte 0 is 0x93)"),
}


@slow
@pytest.mark.parametrize("case", list(SEARCHES))
def test_a_search_that_cannot_run_says_why_naming_the_key_the_user_set(case, tmp_path):
    """search.devices=0 was reported as topology.num_devices=0; a batch that nothing
    divides as "none of the 0 candidates can run" with no reason; a binary calibration
    file as a codec's message naming neither the key nor the file."""
    file = tmp_path / "calibration.json"
    file.write_bytes(b"\x93\x00\xff not json")
    args, sentence = SEARCHES[case]
    err = _refused("pipeflow.search", [a.format(file=file) for a in args], tmp_path)
    assert err.startswith(sentence.format(file=file)), err


def _compare(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return _app("pipeflow.compare.cli", args, cwd)


@slow
def test_compare_names_a_file_it_cannot_read_and_goes_on(tmp_path):
    """A cut-short summary.json showed the run as "incomplete" naming no file; a binary
    metrics.jsonl was a UnicodeDecodeError traceback."""
    from test_compare import cfg, write_run

    write_run(tmp_path, "runs/good", cfg("1f1b"), [2.0, 1.0])
    cut = write_run(tmp_path, "runs/cut", cfg("gpipe"), [2.0, 1.5])
    (cut / "summary.json").write_text('{"kind": "meas')
    binary = write_run(tmp_path, "runs/binary", cfg("zb_h1"), [2.0, 1.2])
    (binary / "metrics.jsonl").write_bytes(b"\x93\xff\x00" * 50)
    proc = _compare([str(tmp_path / "runs"), f"out={tmp_path / 'report'}"], tmp_path)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert f"{cut / 'summary.json'} cannot be read as a JSON object" in proc.stdout
    assert f"{binary / 'metrics.jsonl'} cannot be read as text (not UTF-8)" in proc.stdout
    assert (tmp_path / "report" / "report.html").exists()


@slow
def test_compare_refuses_to_write_over_a_report_or_into_a_run(tmp_path):
    from test_compare import cfg, write_run

    run = write_run(tmp_path, "runs/a", cfg("1f1b"), [2.0, 1.0])
    out = tmp_path / "report"
    assert _compare([str(tmp_path / "runs"), f"out={out}"], tmp_path).returncode == 0
    before = (out / "report.html").stat().st_mtime_ns
    again = _compare([str(tmp_path / "runs"), f"out={out}"], tmp_path)
    assert again.returncode == 2 and again.stderr.strip() == (
        f"pipeflow-compare: out={out}: the folder holds another report (report.html, runs.csv, configurations.csv); "
        f"give a new folder, or overwrite=true to write over it")
    assert (out / "report.html").stat().st_mtime_ns == before
    into = _compare([str(tmp_path / "runs"), f"out={run}"], tmp_path)
    assert into.returncode == 2 and into.stderr.strip().startswith(
        f"pipeflow-compare: out={run}: it is (or lies inside) {tmp_path / 'runs'}, a run being compared")
    assert not (run / "report.html").exists()
    assert _compare([str(tmp_path / "runs"), f"out={out}", "overwrite=true"], tmp_path).returncode == 0


def _children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry))
    return kids


@slow
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads the process table from /proc")
@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT, started with SIGINT ignored"])
def test_a_stopped_search_takes_its_workers_with_it(how, tmp_path):
    """SIGTERM left both forked workers running, reparented to init; a search started as a
    script's background job (SIGINT ignored) ignored Ctrl-C."""
    import signal
    import time

    sig = signal.SIGTERM if how == "SIGTERM" else signal.SIGINT
    ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sig == signal.SIGINT else None
    env = _env()
    proc = subprocess.Popen([sys.executable, "-m", "pipeflow.search", "search.global_batch=100000", "search.workers=2",
                             "logger=none", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=ignore)
    try:
        start = time.monotonic()
        while len(_children(proc.pid)) < 2 and time.monotonic() - start < 120 and proc.poll() is None:
            time.sleep(0.2)
        workers = _children(proc.pid)
        assert len(workers) == 2, (workers, proc.poll())
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + sig and err.strip().endswith(f"pipeflow-search: stopped by {sig.name}"), err
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{w}").exists() for w in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [w for w in workers if Path(f"/proc/{w}").exists()]


@slow
@pytest.mark.parametrize("multirun", [False, True], ids=["without -m", "-m, no Slurm here"])
def test_the_slurm_launcher_submits_or_says_what_is_missing_and_leaves_nothing(multirun, tmp_path):
    """Without -m the run trained here, exit 0, no notice; with -m and no srun or sbatch,
    a Hydra traceback and multirun.yaml or .submitit/ left behind."""
    env = _env()
    env["PATH"] = str(Path(sys.executable).parent)  # this Python's, and no Slurm
    args = [*(["-m"] if multirun else []), "hydra/launcher=slurm", "trainer.steps=1", "logger=none"]
    proc = subprocess.run([sys.executable, "-m", "pipeflow.train", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    err = proc.stderr.strip()
    assert proc.returncode == 1 and len(err.splitlines()) == 1, err[-2000:]
    if multirun:
        assert err.startswith("hydra/launcher=slurm: sbatch and srun not found on PATH"), err
    else:
        assert err.startswith("hydra/launcher=slurm: a launcher runs a multirun's jobs, so without -m"), err
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_the_slurm_launcher_names_the_extra_it_needs_and_passes_where_slurm_is(tmp_path, monkeypatch):
    from pipeflow.config import ConfigError
    from pipeflow.config.command_line import check_launcher

    for name in ("sbatch", "srun"):  # a login node's commands
        tool = tmp_path / name
        tool.write_text("#!/bin/sh\nexit 0\n")
        tool.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    check_launcher(["-m", "hydra/launcher=slurm"])
    check_launcher(["hydra/launcher=basic"])
    monkeypatch.setitem(sys.modules, "hydra_plugins.hydra_submitit_launcher", None)  # not installed
    with pytest.raises(ConfigError, match=re.escape("hydra/launcher=slurm: needs the slurm extra (pip install -e "
                                                    "'.[slurm]'")):
        check_launcher(["-m", "hydra/launcher=slurm"])


def _check_many(path: str, times: int) -> str:
    from pipeflow.config.command_line import check_output_dir

    try:
        for _ in range(times):
            check_output_dir("hydra.run.dir", path)
    except Exception as err:  # noqa: BLE001 - the message is the result
        return str(err)
    return ""


def test_processes_checking_one_run_folder_at_once_all_pass_and_leave_nothing(tmp_path: Path):
    """torchrun's nodes (and a multirun's jobs) check one hydra.run.dir at the same time:
    a folder another made meanwhile, or let go of under it, is no reason to refuse (two
    nodes once refused with 'cannot write there (File exists)'). No probe file is left
    (a folder one process made while another was writing in it may stay, empty: the
    run is about to use it)."""
    import multiprocessing

    target = tmp_path / "runs" / "nodes"
    with multiprocessing.get_context("fork").Pool(6) as pool:
        errors = pool.starmap(_check_many, [(str(target), 100)] * 6)
    assert errors == [""] * 6
    assert [p for p in tmp_path.rglob("*") if not p.is_dir()] == []


# ------------------------------------------------------- issue 60: refusals that say what can be set
@pytest.mark.parametrize("over,want,absent", [
    (["schedule=pipedream", "pipeline.shard=optimizer"],
     "pipeline.shard=optimizer: schedule 'pipedream' is asynchronous (allowed values here: none)", "schedule.zero"),
    (["schedule=amdp", "pipeline.shard=optimizer"],
     "pipeline.shard=optimizer: schedule 'amdp' is asynchronous; its replicas shard the optimizer state with "
     "schedule.zero=true (allowed values here: none)", None),
    (["model=gpt_tiny", "model.n_head=3"],
     "model.n_embd=128: must be a multiple of model.n_head=3 (each head gets n_embd/n_head dimensions)", "head_dim"),
    (["model=bert_tiny", "model.n_head=3"], "must be a multiple of model.n_head=3", "head_dim"),
    (["model=llama_tiny", "model.seq_len=512"],
     "model.seq_len=512: longer than the model's 256 positions (model.hf.max_position_embeddings; GPT-2's "
     "model.hf.n_positions); use a seq_len <= 256 or raise that key", "model.n_positions"),
    (["pipeline.shard=optimizer"],
     "pipeline.shard=optimizer: no stage of schedule '1f1b' has a replica to share its state with at "
     "pipeline.data_parallel=1; set pipeline.data_parallel to 2 or more, or pipeline.shard=none", None),
])
def test_a_refusal_names_only_keys_the_user_can_set(over, want, absent):
    """Three refusals suggested keys these models and schedules do not have (schedule.zero
    for pipedream, model.head_dim for GPT and BERT, n_positions for a Llama), and a
    ZeRO level with nothing to shard was accepted and reported as sharded."""
    from pipeflow.config import ConfigError, compose, prepare_simulation

    with pytest.raises(ConfigError) as err:
        prepare_simulation(compose("simulate", [*over, "topology=local_cpu"]))
    assert want in str(err.value), str(err.value)
    if absent:
        assert absent not in str(err.value)


def test_the_closest_unfit_candidates_show_the_limit_as_given():
    """search.memory_limit_gb=1.5 was printed as a limit of "2", over by "+0.00"."""
    from types import SimpleNamespace

    from pipeflow.planning.search.verdicts import GIB, oom_lines

    label = SimpleNamespace(label=lambda: "1f1b p2 m8")
    q = SimpleNamespace(candidate=label, peak_memory=1.5004 * GIB, memory_limit=1.5 * GIB, over=0.0004 * GIB,
                        device=1, how="closed form")
    lines = oom_lines(SimpleNamespace(out_of_memory=[q], closed=[q, q]), rows=3)
    assert lines[0] == "1 of 2 priced candidates do not fit; the closest:"
    assert lines[2].split()[-6:] == ["1.50", "1.50", "+0.0004", "1", "closed", "form"], lines


# ------------------------------------------- issue 76: values that cannot work, refused before any rank
RANGES = {  # overrides -> the sentence's start (in-process: prepare_training, as pipeflow-train runs it first)
    "a timeout past the store's C int": (["runtime.timeout_s=1e12"], "runtime.timeout_s=1000000000000.0: too long: "
                                         "at most 536870 seconds (about 6.2 days): the launcher's rendezvous store"),
    "a timeout past timedelta": (["runtime.timeout_s=1e20"], "runtime.timeout_s=1e+20: too long: at most 536870"),
    "an endless timeout": (["runtime.timeout_s=inf"], "runtime.timeout_s=inf: too long: at most 536870 seconds"),
    "a timeout under the heartbeat's": (["runtime.timeout_s=0.1"], "runtime.timeout_s=0.1: too short: every wait on "
                                        "another rank ends there"),
    "no timeout": (["runtime.timeout_s=nan"], "runtime.timeout_s=nan: not a number; use 2.5..536870 seconds"),
    "a hang timeout under a beat": (["runtime.hang_timeout_s=0.1"], "runtime.hang_timeout_s=0.1: must be 0 (never) "
                                    "or at least 2.5 seconds: a healthy rank beats every 0.5 s"),
    "a negative hang timeout": (["runtime.hang_timeout_s=-1"], "runtime.hang_timeout_s=-1.0: must be 0 (never)"),
    "an endless loss scale": (["runtime.loss_scale=inf"], "runtime.loss_scale=inf: fp16's first loss scale must be "
                              "a finite number > 0"),
    "threads past torch's pool": (["runtime.threads_per_rank=100000"], "runtime.threads_per_rank=100000: must be a "
                                "whole number in 1.."),
    "a padding past the host's memory": (["model.vocab_multiple=1000000000"], "model.vocab_multiple=1000000000: pads "
                                         "the 256 words to 1,000,000,000 rows, and the model's state (16 bytes a "
                                         "parameter: fp32 weights, gradients, AdamW's two moments) then needs at "
                                         "least 1.86 TiB, more than this host's memory (16 GiB)"),
}


def _host_of_16_gib(monkeypatch):
    from pipeflow.config.groups import runtime

    monkeypatch.setattr(runtime, "host_memory", lambda: (16 * 2**30, "this host's memory"))
    for key in ("RANK", "WORLD_SIZE", "SLURM_STEP_NUM_TASKS"):  # (the ranks start here)
        monkeypatch.delenv(key, raising=False)


@pytest.mark.parametrize("case", list(RANGES))
def test_a_value_that_cannot_work_is_refused_naming_its_range(case, monkeypatch):
    """Accepted until issue 76: timeouts the store turned into a traceback (DistNetworkError
    after "4000000000000000ms", OverflowError) or gloo's unkeyed timeout, a hang timeout
    that failed a healthy run, and a vocabulary padding that started the ranks to die
    allocating hundreds of gigabytes."""
    from pipeflow.config import ConfigError, compose, prepare_training

    _host_of_16_gib(monkeypatch)
    over, sentence = RANGES[case]
    with pytest.raises(ConfigError) as err:
        prepare_training(compose("train", over))
    assert str(err.value).startswith(sentence), str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("over", [["runtime.timeout_s=2.5", "runtime.hang_timeout_s=2.5"],
                                  ["runtime.timeout_s=536870", "runtime.hang_timeout_s=0"],
                                  ["model.vocab_multiple=64"], ["model.vocab_multiple=1000000"]])
def test_the_ends_of_the_ranges_are_accepted(over, monkeypatch):
    from pipeflow.config import compose, prepare_training

    _host_of_16_gib(monkeypatch)
    assert prepare_training(compose("train", over)).plan is not None


def test_the_ranges_are_the_launchers_own():
    """The config cannot import the runtime: its copies of the heartbeat and of the store's
    wait (4 x runtime.timeout_s) are held to the launcher's here."""
    from pipeflow.config.groups import runtime as group

    runtime = Path(SOURCE) / "pipeflow" / "runtime"  # (read, not imported: the runtime imports torch)
    supervise = (runtime / "supervise.py").read_text()
    assert f"\nBEAT = {group.BEAT_S}  #" in supervise and "3 * BEAT + 1.0" in supervise
    for module in ("launch.py", "calibration_run.py"):
        assert f"runtime.timeout_s * {group.STORE_WAITS}" in (runtime / module).read_text(), module
    assert group.MAX_TIMEOUT_S * group.STORE_WAITS * 1000 <= 2**31 - 1


def test_padding_on_ranks_elsewhere_is_held_to_the_table_on_one_rank(monkeypatch):
    """GPUs (or a cluster launcher's ranks): the rank holding the token table holds its
    weights and gradient at least, split by tensor parallelism; whether the padding or
    the model is too large, a padding that alone overflows the device is named."""
    from pipeflow.config import ConfigError, compose
    from pipeflow.config.groups import model
    from pipeflow.planning.transformer import TransformerSpec

    monkeypatch.setattr(model, "rank_memory", lambda rt: (2**30, "GPU 0's memory", False))
    cfg = compose("train", ["model.vocab_multiple=10000000"])  # gpt_tiny: 128 wide
    spec = TransformerSpec.from_config(cfg.model)
    with pytest.raises(ConfigError, match=r"^model.vocab_multiple=10000000: pads the 256 words to 10,000,000 rows, "
                                          r"and the token table's fp32 weights and gradient on the rank that holds it "
                                          r"then needs at least 9.54 GiB, more than GPU 0's memory \(1 GiB\)"):
        model.check_vocab_memory(cfg, spec)
    model.check_vocab_memory(cfg, spec, tensor=16)  # 0.6 GiB a rank
    cfg.model.vocab_multiple = 64
    model.check_vocab_memory(cfg, TransformerSpec.from_config(cfg.model))


def test_compile_true_builds_a_tiny_function_before_any_rank(monkeypatch, tmp_path):
    """CXX=/bin/false passed the check (it was found) and failed in the ranks, torch's
    "Set TORCHDYNAMO_VERBOSE=1" as the failure's line; the compiler inductor runs now
    builds a tiny OpenMP function first, once per compiler a process."""
    from pipeflow.config import ConfigError, compose
    from pipeflow.config.groups import compile as group
    from pipeflow.config.assembly import generate_schedule

    cfg = compose("train", ["compile=true"])
    schedule = generate_schedule(cfg)
    monkeypatch.setenv("CXX", "/bin/false")
    with pytest.raises(ConfigError) as err:
        group.check_compile(cfg, schedule, on_gpus=False)
    assert str(err.value) == ("compile=true: the C++ compiler inductor would build the CPU ranks' kernels with, "
                              "/bin/false (CXX), could not build a tiny function (exit status 1, no message); set CXX "
                              "to a working g++ or clang++, or use compile=false")
    group.check_compile(cfg, schedule, on_gpus=True)  # (Triton's kernels: no C++ compiler)
    talks = tmp_path / "cxx"
    talks.write_text("#!/bin/sh\necho \"$0: fatal error: omp.h: No such file or directory\" >&2\nexit 4\n")
    talks.chmod(0o755)
    monkeypatch.setenv("CXX", str(talks))
    with pytest.raises(ConfigError, match="could not build a tiny function \\(exit status 4: .*cxx: fatal error: "
                                          "omp.h: No such file or directory\\)"):
        group.check_compile(cfg, schedule, on_gpus=False)
    monkeypatch.setenv("CXX", str(tmp_path / "nowhere"))
    with pytest.raises(ConfigError, match=f"and CXX='{tmp_path / 'nowhere'}' was not found"):
        group.check_compile(cfg, schedule, on_gpus=False)
    runs = []
    real = group.subprocess.run
    monkeypatch.setattr(group.subprocess, "run", lambda *a, **k: runs.append(a) or real(*a, **k))
    group.compiler_fault.cache_clear()
    assert group.compiler_fault("/bin/true") is None and group.compiler_fault("/bin/true") is None
    assert len(runs) == 1
