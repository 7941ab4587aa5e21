"""The ``hf_causal`` family's configuration side: a Hugging Face decoder read from a local
``config.json`` or model folder (never a hub). :func:`load_hf_config` builds the
transformers config, :func:`shape_keys` reads it as pipeflow's shape keys (``n_layer``,
``n_embd``, ``mlp``, ...) and :func:`resolve` fills them into the ``model`` group before any
rank starts. Imports torch (through transformers) only for this family."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping


@dataclass(frozen=True)
class Architecture:
    """Where a decoder's parts live in transformers' module tree, and how its layers are shaped."""

    model_type: str
    base: str  # the decoder stack's attribute on the *ForCausalLM model
    embed: str  # token embedding, on the base
    layers: str  # the decoder layers (a ModuleList), on the base
    norm: str  # final norm, on the base
    head: str  # LM head, on the *ForCausalLM model
    cache_kw: str  # the keyword a decoder layer takes its key/value cache by
    rotary: str | None = None  # rotary table module, on the base (None: learned positions)
    positions: str | None = None  # learned position embedding, on the base
    dropout: str | None = None  # embedding dropout, on the base
    mlp: str = "gated"  # gated: gate, up, down (SwiGLU); gelu: two matrices
    norm_kind: str = "rmsnorm"
    attention: str = "self_attn"  # the layer's attention sub-module (selective recomputation)
    grouped_kv: bool = True  # reads num_key_value_heads (grouped-query attention)


_LLAMA = dict(base="model", embed="embed_tokens", layers="layers", norm="norm", head="lm_head",
              cache_kw="past_key_values", rotary="rotary_emb")
ARCHITECTURES: dict[str, Architecture] = {
    a.model_type: a
    for a in (
        Architecture("llama", **_LLAMA),
        Architecture("qwen2", **_LLAMA),
        Architecture("mistral", **_LLAMA),
        Architecture("gpt_neox", base="gpt_neox", embed="embed_in", layers="layers", norm="final_layer_norm",
                     head="lm_head", cache_kw="layer_past", rotary="rotary_emb", dropout="emb_dropout",
                     mlp="gelu", norm_kind="layernorm", attention="attention", grouped_kv=False),
        Architecture("gpt2", base="transformer", embed="wte", layers="h", norm="ln_f", head="lm_head",
                     cache_kw="past_key_values", positions="wpe", dropout="drop", mlp="gelu",
                     norm_kind="layernorm", attention="attn", grouped_kv=False),
    )
}

# what resolve() writes into the model group; set by the HF config, not by hand
SHAPE_KEYS = ("n_layer", "n_head", "n_embd", "n_inner", "vocab_size", "n_positions", "n_kv_head", "head_dim",
              "mlp", "norm", "qkv_bias", "o_bias", "mlp_bias", "tied", "positions", "dropout")


def architecture(model_type: str) -> Architecture:
    arch = ARCHITECTURES.get(model_type)
    if arch is None:
        raise ValueError(f"model_type '{model_type}' is not supported by model.family=hf_causal; "
                         f"supported model types: {', '.join(ARCHITECTURES)}")
    return arch


def _read_config_file(path: str) -> dict:
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ValueError(f"model.config={path}: no such file (a config.json, or a local model folder holding "
                         f"one; nothing is downloaded)")
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"model.config={path}: not a readable config.json ({err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"model.config={path}: not a config.json (a JSON object with a model_type)")
    return data


def hf_fields(model_cfg: Mapping) -> dict:
    """The transformers config fields: ``model.config``'s file, then ``model.hf`` over it."""
    fields: dict[str, Any] = {}
    if model_cfg.get("config"):
        fields.update(_read_config_file(str(model_cfg["config"])))
    hf = model_cfg.get("hf") or {}
    fields.update({str(k): (dict(v) if isinstance(v, Mapping) else v) for k, v in dict(hf).items()})
    if "model_type" not in fields:
        raise ValueError("model.config: model.family=hf_causal needs a config.json (model.config=<file or local "
                         "folder>) or model.hf.model_type; supported model types: " + ", ".join(ARCHITECTURES))
    try:
        architecture(str(fields["model_type"]))
    except ValueError as err:
        where = f"model.hf.model_type={hf['model_type']}" if "model_type" in hf \
            else f"model.config={model_cfg.get('config')}"
        raise ValueError(f"{where}: {err}") from None
    return fields


# the shape fields a config must give (transformers would fill a missing one with its
# preset's, Llama's 4096 wide and 32 deep), by transformers' name; GPT-2 names four its own way
REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
POSITIVE = (*REQUIRED, "intermediate_size", "num_key_value_heads", "head_dim", "max_position_embeddings", "n_inner")


def check_shape_fields(fields: Mapping, model_type: str, model_cfg: Mapping) -> None:
    """ValueError, naming the field, for a config that leaves out a shape field (but GPT-2's MLP
    width), gives one that is not a whole number >= 1, or has heads that do not divide the
    width (without head_dim) or query heads that key/value heads do not divide."""
    from transformers import CONFIG_MAPPING

    aliases = dict(getattr(CONFIG_MAPPING[model_type], "attribute_map", {}) or {})
    hf = model_cfg.get("hf") or {}

    def where(name: str) -> str:
        key = aliases.get(name, name) if aliases.get(name, name) in fields else name
        if key in hf:
            return f"model.hf.{key}={hf[key]}"
        return f"model.config={model_cfg.get('config')} ({key}: {fields.get(key)!r})"

    def value(name: str):
        for key in (name, aliases.get(name)):
            if key and key in fields:
                return fields[key]
        return None

    required = REQUIRED + (() if model_type == "gpt2" else ("intermediate_size",))
    missing = [aliases.get(n, n) for n in required if value(n) is None]
    if missing:
        given = f"model.config={model_cfg['config']}" if model_cfg.get("config") else "model.hf"
        raise ValueError(f"{given}: gives no {', '.join(missing)}; set "
                         + ", ".join(f"model.hf.{m}=<n>" for m in missing)
                         + " (transformers would fill in its preset's, e.g. a width of 4096)")
    for name in POSITIVE:
        v = value(name)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{where(name)}: must be a whole number of at least 1")
    H, h = value("hidden_size"), value("num_attention_heads")
    if value("head_dim") is None and H % h:
        raise ValueError(f"{where('num_attention_heads')}: must divide the width {H} "
                         f"({aliases.get('hidden_size', 'hidden_size')}), or set model.hf.head_dim")
    kv = value("num_key_value_heads")
    if architecture(model_type).grouped_kv and kv is not None and h % kv:
        raise ValueError(f"{where('num_key_value_heads')}: must divide the {h} query heads (num_attention_heads)")


def load_hf_config(model_cfg: Mapping):
    """The transformers config of an ``hf_causal`` model (no cache; transformers' fused
    attention, which pipeflow's stages replace with their own: pipeflow.models.attention)."""
    from transformers import AutoConfig

    fields = hf_fields(model_cfg)
    model_type = str(fields.pop("model_type"))
    for key in ("architectures", "transformers_version", "torch_dtype", "dtype", "_name_or_path"):
        fields.pop(key, None)
    check_shape_fields(fields, model_type, model_cfg)
    try:
        config = AutoConfig.for_model(model_type, **fields)
    except Exception as err:  # noqa: BLE001 - transformers' own checks (strict dataclasses, arithmetic)
        reason = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
        raise ValueError(f"model.hf: not a valid {model_type} config ({reason})") from None
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):  # GPT-2's 50256 means nothing to a byte vocabulary
        value = getattr(config, key, None)
        if isinstance(value, int) and not 0 <= value < config.vocab_size:
            setattr(config, key, None)
    config.use_cache = False
    config._attn_implementation = "sdpa"
    return config


def _dropout(config) -> float:
    names = ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop")
    return max([float(getattr(config, n, 0.0) or 0.0) for n in names])


def _kv_heads(config, heads: int) -> int:
    kv = getattr(config, "num_key_value_heads", None)
    return heads if kv is None else int(kv)  # a 0 stays 0, for the spec's check to name


def shape_keys(config) -> dict:
    """pipeflow's shape keys of a transformers config (:data:`SHAPE_KEYS`)."""
    t = config.model_type
    arch = architecture(t)
    H, h = int(config.hidden_size), int(config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None)  # explicit, or the width's share (checked to divide)
    head_dim = H // h if head_dim is None else head_dim
    if t == "gpt2":
        inner = config.n_inner or 4 * H
    else:
        inner = int(config.intermediate_size)
    if t in ("llama", "mistral"):
        qkv = o = bool(getattr(config, "attention_bias", False))
        mlp_bias = bool(getattr(config, "mlp_bias", False))
    elif t == "qwen2":
        qkv, o, mlp_bias = True, False, False  # Qwen2: biases on Q, K, V only
    else:  # GPT-NeoX and GPT-2: every linear has a bias
        qkv = o = bool(getattr(config, "attention_bias", True))
        mlp_bias = True
    return {
        "n_layer": int(config.num_hidden_layers),
        "n_head": h,
        "n_embd": H,
        "n_inner": int(inner),
        "vocab_size": int(config.vocab_size),
        "n_positions": int(config.max_position_embeddings),
        # grouped-query attention: Llama, Qwen2 and Mistral (GPT-NeoX and GPT-2 ignore the field)
        "n_kv_head": _kv_heads(config, h) if arch.grouped_kv else h,
        "head_dim": int(head_dim),
        "mlp": arch.mlp,
        "norm": arch.norm_kind,
        "qkv_bias": qkv,
        "o_bias": o,
        "mlp_bias": mlp_bias,
        "tied": bool(getattr(config, "tie_word_embeddings", False)),
        "positions": "learned" if arch.positions else "rotary",
        "dropout": _dropout(config),
    }


def resolve(model_cfg) -> dict:
    """The shape keys of an ``hf_causal`` model config, checked against what a user set by
    hand: a key given both ways must agree (the HF config is the source)."""
    config = load_hf_config(model_cfg)
    keys = shape_keys(config)
    if model_cfg.get("weights"):
        check_weights(model_cfg, config)
    for key, value in keys.items():
        given = model_cfg.get(key)
        if given is not None and key != "dropout" and given != value:
            raise ValueError(f"model.{key}={given}: the HF config says {value}; set it there "
                             f"(model.hf.<field>) or leave model.{key} unset")
    return keys


# ---- a local checkpoint (model.weights) -------------------------------------------------

HEADER_LIMIT = 100 * 2**20  # a safetensors header is JSON of names, dtypes, shapes and offsets


def weight_files(path: str) -> list[Path]:
    """The ``*.safetensors`` files ``model.weights`` names: the file itself, or those of
    a local model folder."""
    p = Path(path).expanduser()
    if p.is_file():
        if p.suffix != ".safetensors":
            raise ValueError(f"model.weights={path}: not a .safetensors file (give a checkpoint's *.safetensors "
                             f"file or its folder)")
        return [p]
    if p.is_dir():
        files = sorted(p.glob("*.safetensors"))
        if not files:
            raise ValueError(f"model.weights={path}: no *.safetensors files in that folder")
        return files
    raise ValueError(f"model.weights={path}: no such file or folder")


def safetensors_shapes(file: Path) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape from a safetensors file's header, read without loading a tensor;
    ValueError naming a file cut short or not safetensors."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 2 or n > min(size - 8, HEADER_LIMIT):
            raise ValueError(f"model.weights={file}: not a safetensors file (it does not start with a header's "
                             f"length: {size} bytes)")
        try:
            meta = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise ValueError(f"model.weights={file}: not a safetensors file (its header is not JSON)") from None
    if not isinstance(meta, dict):
        raise ValueError(f"model.weights={file}: not a safetensors file (its header is not a JSON object)")
    shapes, end = {}, 0
    for name, entry in meta.items():
        if name == "__metadata__":
            continue
        try:
            shapes[name] = tuple(int(d) for d in entry["shape"])
            end = max(end, int(entry["data_offsets"][1]))
        except (TypeError, KeyError, IndexError, ValueError):
            raise ValueError(f"model.weights={file}: not a safetensors file (its entry {name!r} has no shape "
                             f"and offsets)") from None
    if 8 + n + end > size:
        raise ValueError(f"model.weights={file}: cut short: its tensors end at byte {8 + n + end:,}, "
                         f"the file has {size:,}")
    return shapes


def check_weights(model_cfg: Mapping, config) -> None:
    """``model.weights`` against the model: every parameter by name (a tied head from the
    embedding) with its shape, from the files' headers and a model on the meta device."""
    import torch
    from transformers import AutoModelForCausalLM

    path = str(model_cfg["weights"])
    found: dict[str, tuple[int, ...]] = {}
    for file in weight_files(path):
        found.update(safetensors_shapes(file))
    with torch.device("meta"):
        whole = AutoModelForCausalLM.from_config(config)
    arch = architecture(config.model_type)
    embed, head = f"{arch.base}.{arch.embed}.weight", f"{arch.head}.weight"
    want = {name: tuple(p.shape) for name, p in whole.named_parameters(remove_duplicate=False)}
    alias = {head: embed} if getattr(config, "tie_word_embeddings", False) else {}
    got = {name: found.get(name, found.get(alias.get(name, ""))) for name in want}
    missing = [name for name, shape in got.items() if shape is None]
    if missing:
        raise ValueError(f"model.weights={path}: the checkpoint lacks {', '.join(missing[:4])}"
                         + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
                         + f" ({len(found)} tensors there, {len(want)} in the model's config)")
    for name, shape in got.items():
        if shape != want[name]:
            raise ValueError(f"model.weights={path}: {name} is {shape} there, {want[name]} in the model's config")
