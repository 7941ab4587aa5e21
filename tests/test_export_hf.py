"""export=hf (issue 60): a trained hf_causal run as a Hugging Face folder that
transformers loads, giving the logits pipeflow's own model gives with the run's final
weights. Trained on 2 stages (tensor-parallel for the Qwen2), so the folder is
assembled from a checkpoint of pieces, the tied head (Qwen2) saved once."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch


slow = pytest.mark.slow  # starts ranks

SMALL = ["model.hf.num_hidden_layers=2", "model.seq_len=32", "pipeline.microbatches=2", "pipeline.microbatch_size=2",
         "trainer.steps=1", "trainer.val_every=0", "trainer.val_batches=1", "trainer.timeline_step=null",
         "logger=none", "data.max_bytes=100000", "export=hf"]


@slow
@pytest.mark.parametrize("model,extra", [("llama_tiny", []), ("qwen2_tiny", ["pipeline.tensor_parallel=2"])])
def test_an_exported_run_loads_in_transformers_with_pipeflows_logits(model, extra, tmp_path):
    from transformers import AutoModelForCausalLM

    from pipeflow.models.hf_causal import build_model

    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "pipeflow.train", f"model={model}", *SMALL, *extra,
                           f"hydra.run.dir={run}"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert f"wrote the trained model as a Hugging Face folder: {run / 'hf'}" in proc.stdout + proc.stderr
    loaded = AutoModelForCausalLM.from_pretrained(run / "hf", attn_implementation="eager").eval()
    # pipeflow's own model with the final weights, read from the checkpoint by name
    cfg = json.loads((run / "config.json").read_text())["model"]
    ours = build_model(cfg, seed=0).eval()
    params = {}
    for f in (run / "checkpoints" / "step_0000001").glob("rank*.pt"):
        params.update(torch.load(f, weights_only=False)["params"])
    with torch.no_grad():
        for name, p in ours.named_parameters():
            p.copy_(params[name])
    assert set(params) == {n for n, _ in ours.named_parameters()}
    ids = torch.randint(0, cfg["hf"]["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ours(ids)
        got = loaded(ids).logits
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    # the weights did train: the step-1 weights are not the initial ones
    assert not torch.equal(params[ours.embed_name], build_model(cfg, seed=int(json.loads(
        (run / "config.json").read_text())["seed"])).state_dict()[ours.embed_name])


def test_export_refuses_a_model_transformers_has_no_folder_for():
    from pipeflow.config import ConfigError, compose, prepare_training

    with pytest.raises(ConfigError, match=r"^export=hf: model.family=gpt is no Hugging Face decoder"):
        prepare_training(compose("train", ["model=gpt_tiny", "export=hf"]))
    # the concurrent-branch model too, before any rank starts (it was refused only after training)
    with pytest.raises(ConfigError, match=r"^export=hf: model.family=cbm is no Hugging Face decoder"):
        prepare_training(compose("train", ["model=cbm", "data=image_text", "export=hf"]))
    with pytest.raises(ConfigError, match=r"^export=onnx: allowed values: hf \(or null\)"):
        prepare_training(compose("train", ["model=llama_tiny", "export=onnx"]))


# ------------------------------------------------------------ issue 76: nothing lost, one sentence

@pytest.fixture(scope="module")
def hf_run(tmp_path_factory):
    """A run folder as pipeflow-train leaves it, without starting ranks: its config.json
    and a whole checkpoint at step 1 (format 2: the llama_tiny's parameters by name)."""
    from omegaconf import OmegaConf

    from pipeflow.config import compose
    from pipeflow.formats.checkpoint_folder import model_record
    from pipeflow.models.hf_causal import build_model

    cfg = compose("train", ["model=llama_tiny", "model.hf.num_hidden_layers=2"])
    plain = OmegaConf.to_container(cfg, resolve=True)
    run = tmp_path_factory.mktemp("hf") / "run"
    folder = run / "checkpoints" / "step_0000001"
    folder.mkdir(parents=True)
    params = {k: v.clone() for k, v in build_model(plain["model"], seed=0).state_dict().items()}
    torch.save({"step": 1, "format": 2, "params": params, "optim": {}}, folder / "rank0.pt")
    (folder / "meta.json").write_text(json.dumps({
        "step": 1, "format": 2, "chunk_start": 1, "world_size": 1, "meta": {"model": model_record(plain["model"])},
        "files": {"rank0.pt": (folder / "rank0.pt").stat().st_size}, "names": {"rank0.pt": sorted(params)}}))
    (run / "checkpoints" / "latest").write_text("1\n")
    (run / "config.json").write_text(json.dumps(plain))
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    return run


def _export(*args) -> tuple[int, str]:
    import contextlib
    import io

    from pipeflow.formats.hf_folder import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main([str(a) for a in args])
    return code, err.getvalue()


def _copy(run, tmp_path):
    import shutil

    return shutil.copytree(run, tmp_path / "run")


def test_export_onto_a_full_disk_says_so_and_leaves_no_half_folder(hf_run, tmp_path, monkeypatch):
    """Issue 76: onto a full disk the export printed safetensors' traceback and left
    OUT holding config.json without weights. Now one sentence, and OUT as it was: absent,
    or a previous export untouched."""
    import safetensors.torch
    from safetensors import SafetensorError

    out = tmp_path / "out"
    assert _export(hf_run, out) == (0, "")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert set(before) == {"config.json", "model.safetensors"}

    def full_disk(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"partial")  # what a full disk leaves: a file cut short
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    for target in (tmp_path / "new", out):
        code, said = _export(hf_run, target)
        assert code == 1 and said == f"could not write {target}: No space left on device\n"
    assert not (tmp_path / "new").exists()
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # nothing aside left behind


def test_export_refuses_a_run_folder_or_a_folder_of_other_files(hf_run, tmp_path):
    """Issue 76: `hf_folder RUN RUN` replaced the run's config.json with transformers'
    without a word (the run could not be exported again, pipeflow-compare lost its seed).
    A run folder, a folder holding anything but an export, and a file are refused, and
    left as they were."""
    run = _copy(hf_run, tmp_path)
    config = (run / "config.json").read_text()
    code, said = _export(run, run)
    assert code == 1 and said == (f"{run} is a run folder, whose config.json an export would replace; give another "
                                  f"output folder (the default is {run / 'hf'})\n")
    assert (run / "config.json").read_text() == config and not (run / "model.safetensors").exists()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    code, said = _export(run, tmp_path / "mine")
    assert code == 1 and said.startswith(f"{tmp_path / 'mine'} holds notes.txt, which no export writes")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"
    code, said = _export(run, tmp_path / "mine" / "notes.txt")
    assert code == 1 and said == f"{tmp_path / 'mine' / 'notes.txt'} is a file, not a folder; give a new folder " \
                                 f"for the export\n"
    # the default, and a previous export, are written (replaced whole)
    assert _export(run) == (0, "") and _export(run, run / "hf") == (0, "")
    assert sorted(p.name for p in (run / "hf").iterdir()) == ["config.json", "model.safetensors"]


def test_export_checks_its_checkpoint_as_resume_does_naming_its_argument(hf_run, tmp_path):
    """Issue 76: errors named `resume=...` (not the export's argument), `latest` naming a
    step folder that is gone said the step was incomplete, and a rank file cut short or
    not a checkpoint ended in a traceback."""
    run = _copy(hf_run, tmp_path)
    step = run / "checkpoints" / "step_0000001"
    rank0 = step / "rank0.pt"
    (run / "checkpoints" / "latest").write_text("9\n")
    code, said = _export(run, tmp_path / "out")
    assert code == 1 and said == (f"{run}: checkpoints/latest names step 9, whose folder "
                                  f"{run / 'checkpoints' / 'step_0000009'} is missing; give one of its "
                                  f"checkpoints/step_N folders (step_0000001)\n")
    size = rank0.stat().st_size
    rank0.write_bytes(b"x" * size)  # the recorded size, but no checkpoint
    code, said = _export(step, tmp_path / "out")
    assert code == 1 and said.startswith(f"{step}: {rank0} cannot be read (") and said.count("\n") == 1
    rank0.write_bytes(b"x" * 50)
    code, said = _export(step, tmp_path / "out")
    assert code == 1 and said == f"{step}: {rank0} has 50 bytes where {size} were written (cut short or changed " \
                                 f"since)\n"
    (step / "meta.json").unlink()
    code, said = _export(step, tmp_path / "out")
    assert code == 1 and said.startswith(f"{step}: {step} is incomplete (no meta.json")
    assert not (tmp_path / "out").exists()


def test_export_of_a_run_whose_config_is_not_pipeflows_says_so(hf_run, tmp_path):
    """A run whose config.json an earlier export replaced (issue 76) said `RUN: 'model'`."""
    run = _copy(hf_run, tmp_path)
    (run / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    code, said = _export(run, tmp_path / "out")
    assert code == 1 and said == (f"{run}: {run / 'config.json'} is not the config pipeflow-train wrote (no model "
                                  f"group), and it names the model the checkpoint holds; export from a run folder "
                                  f"whose config.json pipeflow-train wrote\n")
