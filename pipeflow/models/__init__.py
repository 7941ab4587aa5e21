"""Models split into pipeline stages (torch): GPT, BERT and the concurrent-branch vision + text model."""

from .gpt import GPTStage, build_model, build_stage, gpt2_config, hidden_shape, lm_loss

__all__ = ["GPTStage", "build_model", "build_stage", "gpt2_config", "hidden_shape", "lm_loss"]
