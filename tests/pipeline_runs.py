"""Shared by the runtime tests: run a composed training config on real CPU ranks and
read back what the ranks wrote (losses, dumped gradients, summary)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from pipeflow.config import compose, prepare_training
from pipeflow.runtime.launch import TrainJob, launch


# a GPT small enough for CI (2 cores), deep enough for 4 stages x 2 virtual stages
GPT_SMALL = [
    "model.n_layer=8",
    "model.n_embd=64",
    "model.n_head=4",
    "model.seq_len=64",
    "pipeline.microbatches=4",
    "pipeline.microbatch_size=2",
    "optim.warmup_steps=2",
    "trainer.val_every=0",
    "trainer.val_batches=1",
    "trainer.timeline_step=2",
    "logger=none",
]


# the GPT's LM head is tied to its token embedding: its gradient is the embedding's
GPT_TIED = {"lm_head.weight": "wte.weight"}

# a small shape of each supported Hugging Face architecture (model.hf fields over
# llama_tiny's; GPT-2's dropout off, so that training-mode forwards compare)
SMALL_HF = {
    "llama": [],
    "qwen2": ["model=qwen2_tiny"],
    "mistral": ["model.hf.model_type=mistral", "+model.hf.sliding_window=8"],
    "gpt_neox": ["model.hf.model_type=gpt_neox"],
    "gpt2": ["model.hf.model_type=gpt2", "+model.hf.n_embd=64", "+model.hf.n_layer=4", "+model.hf.n_head=4",
             "+model.hf.n_positions=128", "+model.hf.resid_pdrop=0", "+model.hf.embd_pdrop=0",
             "+model.hf.attn_pdrop=0"],
}


def assert_same_grads(got: dict, want: dict, rtol: float = 1e-4, atol: float = 1e-6, close=None,
                      msg: str = "") -> int:
    """``got``'s gradients equal ``want``'s: the same parameter names on both sides, at
    least one of them, and every copy ``got`` reports of a parameter (replicas, a tied
    embedding's copies: each holds the whole gradient) close to ``want``'s one gradient,
    within ``rtol`` and ``atol`` times that gradient's largest entry (``close(got, want,
    name)`` compares instead where given). Both are name -> list of tensors, as
    :func:`train` reads them. Returns how many tensors were compared."""
    assert want, f"{msg}: the reference dumped no gradient"
    assert set(got) == set(want), f"{msg}: parameters on one side only: {sorted(set(got) ^ set(want))[:6]}"
    compared = 0
    for name, ref in want.items():
        (ref,) = ref  # a reference is one device: one copy of each
        assert got[name], f"{msg}: no gradient of {name}"
        for copy in got[name]:
            if close is not None:
                close(copy, ref, name)
            else:
                torch.testing.assert_close(copy, ref, rtol=rtol, atol=atol * float(ref.abs().max()),
                                           msg=f"{msg} {name}".strip())
            compared += 1
    return compared


def metrics(run_dir: Path) -> list[dict]:
    """The rows of a run's metrics.jsonl."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train(run_dir: Path, overrides: list[str], tied: dict[str, str] | None = None) -> dict:
    """Train ``compose("train", overrides)``; ``tied`` files a tied copy's gradient
    under the name of the parameter it mirrors (e.g. lm_head.weight -> wte.weight)."""
    cfg = compose("train", overrides)
    inputs = prepare_training(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    launch(TrainJob(inputs.plan, str(run_dir)))
    grads: dict[str, list[torch.Tensor]] = {}
    for f in sorted((run_dir / "grads").glob("rank*.pt")):
        for key, g in torch.load(f).items():
            name = key.split(":", 1)[1]  # "<pipe>:<name>": replicas report the same name
            grads.setdefault((tied or {}).get(name, name), []).append(g)
    summary = run_dir / "summary.json"
    return {
        "losses": [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()],
        "grads": grads,
        "summary": json.loads(summary.read_text()) if summary.exists() else None,
        "schedule": inputs.schedule,
    }


# the session's sweep through the real app (conftest.py's schedule_sweep): one asynchronous
SWEEP_SCHEDULES = ["gpipe", "1f1b", "pipedream"]
SWEEP_ARGS = ["model.n_layer=4", "model.n_embd=32", "model.n_head=2", "model.seq_len=32", "pipeline.microbatches=4",
              "pipeline.microbatch_size=2", "trainer.steps=6", "trainer.val_every=3", "trainer.val_batches=1",
              "trainer.timeline_step=2", "data.max_bytes=200000"]


def global_batch_reference(run_dir: Path, small: list[str]) -> dict:
    """One device on the global batch of two replicas (2 x 4 microbatches): what
    data-parallel runs of ``small`` (GPT_SMALL and their trainer settings) must match."""
    return train(run_dir, [*small, "pipeline.stages=1", "pipeline.microbatches=8"], tied=GPT_TIED)
