"""A trained ``hf_causal`` run as a Hugging Face folder (``config.json`` and
``model.safetensors``) that ``transformers`` loads with ``from_pretrained``.

The run's checkpoint holds every parameter once, whole, under transformers' own name
(:mod:`pipeflow.runtime.checkpoint`), whatever layout trained it: the folder is those
tensors as they are, and the model's transformers config. A tied head is the embedding
(transformers ties it again on loading); an untied one is saved under its own name.

``pipeflow-train ... export=hf`` writes ``<run folder>/hf`` once the run ends; for a run
that already ended::

    python -m pipeflow.formats.hf_folder <run folder or checkpoints/step_N> [<out folder>]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .checkpoint_folder import read_meta, resolve

def export_hf(checkpoint: str | Path, out: str | Path, model_cfg: dict | None = None) -> Path:
    """Write the checkpoint ``checkpoint`` names (a run folder: its latest) as a Hugging
    Face folder ``out``; ``model_cfg``: the run's model group (else the run's
    ``config.json``'s). Returns ``out``."""
    import torch
    from safetensors.torch import save_file

    from ..hf import load_hf_config

    folder, _ = resolve(str(checkpoint))
    record = read_meta(folder, str(checkpoint))
    if int(record.get("format", 1)) < 2:
        raise ValueError(f"{checkpoint}: a checkpoint of the earlier format (each rank's stages as its layout cut "
                         f"them); resume it once and save again to export it")
    if model_cfg is None:
        model_cfg = json.loads((folder.parent.parent / "config.json").read_text())["model"]
    if model_cfg.get("family") != "hf_causal":
        raise ValueError(f"{checkpoint}: model {model_cfg.get('name')} is no Hugging Face decoder (model.family="
                         f"{model_cfg.get('family')})")
    params: dict[str, torch.Tensor] = {}
    for name in record.get("names", {}):
        params.update(torch.load(folder / name, map_location="cpu", weights_only=False)["params"])
    config = load_hf_config(model_cfg)
    config.architectures = [_architecture(config)]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    save_file({k: v.contiguous() for k, v in sorted(params.items())}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    return out


def _architecture(config) -> str:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM._model_mapping[type(config)].__name__


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help") or len(args) > 2:
        print(__doc__.strip().splitlines()[-1].strip())
        return 0 if args and args[0] in ("-h", "--help") else 2
    run = Path(args[0])
    out = Path(args[1]) if len(args) > 1 else (run if (run / "checkpoints").is_dir() else run.parent.parent) / "hf"
    try:
        export_hf(run, out)
    except (OSError, ValueError, KeyError) as err:
        print(f"{run}: {err}" if str(run) not in str(err) else str(err), file=sys.stderr)
        return 1
    print(f"wrote {out / 'config.json'} and {out / 'model.safetensors'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
