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
    with pytest.raises(ConfigError, match=r"^export=onnx: allowed values: hf \(or null\)"):
        prepare_training(compose("train", ["model=llama_tiny", "export=onnx"]))
