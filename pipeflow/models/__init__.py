"""Models split into pipeline stages (torch): GPT-2 so far."""

from .gpt import GPTStage, build_model, build_stage, gpt2_config, hidden_shape, lm_loss

__all__ = ["GPTStage", "build_model", "build_stage", "gpt2_config", "hidden_shape", "lm_loss"]
