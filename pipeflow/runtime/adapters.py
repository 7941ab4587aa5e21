"""How a model plugs into the runtime: build a stage, feed the first stage, score the
last, and say what a message between two stages looks like (receivers allocate
buffers before the data arrives)."""

from __future__ import annotations

from typing import Mapping, Protocol, Sequence

import torch

from ..data.mlm import IGNORE_INDEX, build_mlm_data
from ..data.text import build_text_data
from ..models import bert
from ..models.gpt import build_stage, hidden_shape, lm_loss
from ..planning.transformer import TransformerSpec


class Adapter(Protocol):
    """What the runtime asks of a model family; one signature for every family (a chain
    family ignores ``stage`` in ``stage_input``, a family without segments ``segment``)."""

    mbs: int  # sequences per microbatch
    seq_len: int
    device: torch.device

    def build_stage(self, stage: int) -> torch.nn.Module: ...

    def stage_input(self, batch, mb: int, stage: int = 0, segment: int = 0) -> torch.Tensor: ...

    def loss(self, out: torch.Tensor, batch, mb: int, normalizer, segment: int = 0) -> torch.Tensor: ...

    def message_spec(self, src_stage: int, dst_stage: int, segment: int = 0) -> tuple[tuple[int, ...], torch.dtype]: ...

    def build_data(self, data_cfg: Mapping): ...

    def normalizer(self, batch): ...


class TransformerAdapter:
    """The base of the chain families' adapters: a transformer split into a chain of
    stages exchanging hidden states [mbs, T, n_embd]; a batch is (input ids, targets),
    [B, T] each, scored next-token on the text corpus unless a subclass says otherwise.
    A subclass supplies ``build_stage``. ``spec``: the model's shape, which its stages are
    built to (a run plan carries it; None: read from ``model_cfg`` where a stage is built)."""

    def __init__(
        self,
        model_cfg: Mapping,
        layers_per_stage: Sequence[int],
        microbatch_size: int,
        seq_len: int,
        seed: int,
        device: torch.device,
        segment_lengths: Sequence[int] | None = None,
        spec: TransformerSpec | None = None,
    ):
        self.model_cfg = model_cfg
        self.spec = spec
        # the words the loss scores (the head's logits may be padded past them: model.vocab_multiple)
        self.vocab = model_cfg.get("vocab_size")
        # Seq1F1B: the sequence is cut into segments of these lengths (None: one segment)
        self.segment_lengths = list(segment_lengths) if segment_lengths else None
        self.segment_starts = [sum(self.segment_lengths[:i]) for i in range(len(self.segment_lengths))] \
            if self.segment_lengths else [0]
        self.layers_per_stage = list(layers_per_stage)
        self.num_stages = len(self.layers_per_stage)
        self.mbs = microbatch_size
        self.seq_len = seq_len
        self.seed = seed
        self.device = device
        self._hidden = hidden_shape(model_cfg, microbatch_size, seq_len)
        # pipeline.tensor_parallel: this rank's tensor group (set by the rank before any
        # stage is built; pipeflow.models.tensor_parallel)
        self.tensor = None

    def build_stage(self, stage: int) -> torch.nn.Module:
        raise NotImplementedError(f"{type(self).__name__} builds no stages: a family's adapter supplies build_stage")

    def _split(self, module: torch.nn.Module) -> torch.nn.Module:
        """The stage cut across this rank's tensor group, or whole without one."""
        if self.tensor is None:
            return module
        from ..models.tensor_parallel import shard_stage

        spec = self.spec or TransformerSpec.from_config(self.model_cfg)
        self._head_rows = spec.vocab_size  # (padded past the words where model.vocab_multiple says)
        return shard_stage(module, self.tensor, spec.n_head, spec.n_kv_head)

    def _vocabulary_parallel(self, logits: torch.Tensor) -> bool:
        """Whether the head's logits are this rank's slice of the vocabulary."""
        return self.tensor is not None and logits.size(-1) * self.tensor.size == self._head_rows

    def _rows(self, t: torch.Tensor, mb: int) -> torch.Tensor:
        return t[mb * self.mbs : (mb + 1) * self.mbs].to(self.device, non_blocking=True)

    def _segment(self, t: torch.Tensor, segment: int) -> torch.Tensor:
        if self.segment_lengths is None:
            return t
        lo = self.segment_starts[segment]
        return t[:, lo : lo + self.segment_lengths[segment]]

    def segment_offset(self, segment: int) -> int:
        return self.segment_starts[segment]

    def stage_input(self, batch, mb: int, stage: int = 0, segment: int = 0) -> torch.Tensor:
        return self._segment(self._rows(batch[0], mb), segment)

    def loss(self, logits: torch.Tensor, batch, mb: int, normalizer: float, segment: int = 0) -> torch.Tensor:
        # a segment's token sum over the whole batch's token count: the segments add up to the unsplit loss
        targets = self._segment(self._rows(batch[1], mb), segment)
        if self._vocabulary_parallel(logits):
            from ..models.tensor_parallel import parallel_cross_entropy

            return parallel_cross_entropy(logits, targets, self.tensor, vocab=self.vocab) / normalizer
        return lm_loss(logits, targets, normalizer, self.vocab)

    def message_spec(self, src_stage: int, dst_stage: int, segment: int = 0) -> tuple[tuple[int, ...], torch.dtype]:
        mbs, tokens, width = self._hidden
        if self.segment_lengths is not None:
            tokens = self.segment_lengths[segment]
        if self.tensor is not None and self.tensor.sequence_parallel:  # this rank's slice of the tokens
            tokens //= self.tensor.size
        return (mbs, tokens, width), torch.float32

    def tokens_per_microbatch(self) -> int:
        return self.mbs * self.seq_len

    def build_data(self, data_cfg: Mapping):
        """The data set: any step's batch is a function of (seed, step), on every rank."""
        return build_text_data(data_cfg, self.seq_len, self.seed)

    def normalizer(self, batch) -> float:
        """What microbatch losses are divided by so they add up to the batch mean: every
        target token counts (a masked-LM adapter would count only the masked ones)."""
        return float(batch[1].numel())


class GPTAdapter(TransformerAdapter):
    """A GPT (model.family=gpt) split into a chain of stages, scored next-token."""

    def build_stage(self, stage: int) -> torch.nn.Module:
        return self._split(build_stage(self.model_cfg, self.layers_per_stage, stage, self.seed,
                                       self.spec)).to(self.device)


class BertAdapter(TransformerAdapter):
    """A BERT (masked LM) split into a chain of stages; a batch is (input ids, labels), [B, T]
    each, labels -100 where a position is not scored. Its word embedding (first stage) and
    MLM decoder (last stage) are tied as the GPT's embedding and head are."""

    def build_stage(self, stage: int) -> torch.nn.Module:
        return self._split(bert.build_stage(self.model_cfg, self.layers_per_stage, stage, self.seed,
                                            self.spec)).to(self.device)

    def loss(self, logits: torch.Tensor, batch, mb: int, normalizer: float, segment: int = 0) -> torch.Tensor:
        if self._vocabulary_parallel(logits):
            from ..models.tensor_parallel import parallel_cross_entropy

            return parallel_cross_entropy(logits, self._rows(batch[1], mb), self.tensor, IGNORE_INDEX,
                                          vocab=self.vocab) / normalizer
        return bert.mlm_loss(logits, self._rows(batch[1], mb), normalizer, self.vocab)

    def build_data(self, data_cfg: Mapping):
        """Masked byte windows: any step's batch and masking are a function of (seed, step)."""
        return build_mlm_data(data_cfg, self.seq_len, self.seed)

    def normalizer(self, batch) -> float:
        """The global batch's masked positions: microbatches hold different numbers of them,
        so dividing each microbatch's summed loss by the batch's count makes them add up
        to the batch mean, as on one device."""
        return float((batch[1] != IGNORE_INDEX).sum())


class HFCausalAdapter(TransformerAdapter):
    """A Hugging Face decoder (model.family=hf_causal) split into a chain of stages; it
    feeds and scores as the base does (next-token loss on the text corpus, bytes or a local
    tokenizer's ids). Its head is tied to the embedding only when its config ties them."""

    def build_stage(self, stage: int) -> torch.nn.Module:
        from ..models import hf_causal

        return self._split(hf_causal.build_stage(self.model_cfg, self.layers_per_stage, stage,
                                                 self.seed)).to(self.device)


class CBMAdapter:
    """The concurrent-branch model (model.family=cbm): a DAG of stages (vision chain, text
    chain, interaction edges, fused head). A batch is a dict (image, input_ids, mlm_labels,
    itm_label); each source stage reads its branch's input."""

    def __init__(self, model_cfg: Mapping, microbatch_size: int, seed: int, device: torch.device, num_devices: int,
                 stage_counts: tuple[int, int] | None = None):
        from ..models import cbm

        self._cbm = cbm
        self.model_cfg = model_cfg
        self.mbs = microbatch_size
        self.seed = seed
        self.device = device
        shape = cbm.cbm_shape(model_cfg)
        self.seq_len = shape.seq_len
        # stages per branch: given (bapp: pipeline.stages each), or the grouping's choice
        vs, ts = stage_counts or cbm.cbm_stage_counts(shape, num_devices)
        self.graph, self.specs = cbm.cbm_stage_graph(model_cfg, vs, ts)

    def build_stage(self, stage: int) -> torch.nn.Module:
        return self._cbm.build_cbm_stage(self.model_cfg, self.specs, stage, self.seed).to(self.device)

    def _rows(self, mb: int) -> slice:
        return slice(mb * self.mbs, (mb + 1) * self.mbs)

    def stage_input(self, batch, mb: int, stage: int = 0, segment: int = 0) -> torch.Tensor:
        return self._cbm.source_input(self.specs[stage], batch)[self._rows(mb)].to(self.device)

    def loss(self, out: torch.Tensor, batch, mb: int, normalizer, segment: int = 0) -> torch.Tensor:
        return self._cbm.cbm_loss(out, batch, normalizer, rows=self._rows(mb))

    def message_spec(self, src_stage: int, dst_stage: int, segment: int = 0) -> tuple[tuple[int, ...], torch.dtype]:
        return tuple(self._cbm.message_shape(self.model_cfg, self.specs[src_stage], self.mbs)), torch.float32

    def build_data(self, data_cfg: Mapping):
        from ..data.image_text import build_image_text_data

        return build_image_text_data(data_cfg, self.model_cfg, self.seed)

    def normalizer(self, batch):
        """Pairs (matching loss) and masked tokens (MLM loss) of the global batch."""
        return self._cbm.normalizer(batch)
