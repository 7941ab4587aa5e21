"""Data pipelines (torch, datasets): byte-level text (GPT), masked text (BERT) and image-text pairs (CBM)."""

from .text import ByteTokenizer, PackedText, build_text_data, default_corpus_files, load_corpus_tokens

__all__ = ["ByteTokenizer", "PackedText", "build_text_data", "default_corpus_files", "load_corpus_tokens"]
