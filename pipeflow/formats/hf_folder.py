"""A trained ``hf_causal`` run as a Hugging Face folder (``config.json`` and
``model.safetensors``) that ``transformers`` loads with ``from_pretrained``: the
checkpoint's tensors under transformers' names as they are (a tied head is the embedding),
checked as ``resume=`` checks them, the folder built aside and moved into place.
``pipeflow-train ... export=hf`` writes ``<run folder>/hf``; for a run that already ended::

    python -m pipeflow.formats.hf_folder <run folder or checkpoints/step_N> [<out folder>]"""

from __future__ import annotations

import errno
import json
import os
import re
import sys
from pathlib import Path

from ..faults import Fault
from .checkpoint_folder import model_difference, model_record, whole
from .files import folder_aside

# what an export folder holds: a folder holding anything else is not replaced
EXPORT_FILES = ("config.json", "model.safetensors")


class ExportFailed(Fault, ValueError):
    """A checkpoint that cannot be exported, or an output folder an export may not
    replace, in one sentence naming it and the fix."""


def export_hf(checkpoint: str | Path, out: str | Path, model_cfg: dict | None = None) -> Path:
    """Write the checkpoint ``checkpoint`` names (a run folder: its latest) as a Hugging Face
    folder ``out`` (``model_cfg``: the run's model group, else its ``config.json``'s); return
    ``out``. ExportFailed (not whole, another model, an ``out`` that is no export) before
    writing; WriteFailed naming ``out`` when it cannot be written (``out`` left as it was)."""
    said = str(checkpoint)
    try:
        folder, record = whole(said, said)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ExportFailed(str(err) if str(err).startswith(said) else f"{said}: {err}") from None
    if int(record.get("format", 1)) < 2:
        raise ExportFailed(f"{said}: a checkpoint of the earlier format (each rank's stages as its layout cut "
                           f"them); resume it once and save again to export it")
    run, given = folder.parent.parent, model_cfg is not None
    if model_cfg is None:
        model_cfg = _run_model(run, said)
    if model_cfg.get("family") != "hf_causal":
        raise ExportFailed(f"{said}: model {model_cfg.get('name')} is no Hugging Face decoder (model.family="
                           f"{model_cfg.get('family')})")
    saved = record.get("meta", {}).get("model")
    differs = saved is not None and model_difference(saved, model_record(model_cfg))
    if differs:
        where = "the run's model group" if given else run / "config.json"
        raise ExportFailed(f"{said}: {where} describes another model than the checkpoint holds "
                           f"({differs.split('; ')[0]}); export it with the config.json of the run that wrote it")
    out = Path(out)
    refused = why_not_an_export(out)
    if refused:
        raise ExportFailed(refused)
    params = _params(folder, record, said)
    from ..hf import load_hf_config

    config = load_hf_config(model_cfg)
    config.architectures = [_architecture(config)]
    with folder_aside(out) as aside:
        config.save_pretrained(aside)
        _save_safetensors(params, aside / "model.safetensors")
    return out


def why_not_an_export(out: Path) -> str | None:
    """None, or why ``out`` may not be written as an export: it is a file, a run folder
    (its own ``config.json`` would be lost), or a folder holding anything but an export."""
    if not out.exists():
        return None
    if not out.is_dir():
        return f"{out} is a file, not a folder; give a new folder for the export"
    held = sorted(os.listdir(out))
    if "checkpoints" in held or "metrics.jsonl" in held or _pipeflow_config(out / "config.json"):
        return (f"{out} is a run folder, whose config.json an export would replace; give another output folder "
                f"(the default is {out / 'hf'})")
    others = [name for name in held if name not in EXPORT_FILES]
    if others:
        shown = ", ".join(others[:4]) + (", ..." if len(others) > 4 else "")
        return (f"{out} holds {shown}, which no export writes, and an export replaces its folder whole; give a "
                f"new folder, or a previous export's")
    if "config.json" in held and not _hf_config(out / "config.json"):
        return (f"{out / 'config.json'} is no Hugging Face model's config, and an export replaces its folder whole; "
                f"give a new folder, or a previous export's")
    return None


def _pipeflow_config(path: Path) -> bool:
    """Whether ``path`` is the config.json pipeflow-train writes (a run's resolved config)."""
    data = _json(path)
    return isinstance(data, dict) and isinstance(data.get("model"), dict) and "trainer" in data


def _hf_config(path: Path) -> bool:
    data = _json(path)
    return isinstance(data, dict) and "model_type" in data


def _json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _run_model(run: Path, said: str) -> dict:
    """The model group of the run ``run``'s config.json."""
    path = run / "config.json"
    data = _json(path)
    if not isinstance(data, dict) or not isinstance(data.get("model"), dict):
        why = "is missing or cannot be read" if data is None else \
            "is not the config pipeflow-train wrote (no model group)"
        raise ExportFailed(f"{said}: {path} {why}, and it names the model the checkpoint holds; export from a run "
                           f"folder whose config.json pipeflow-train wrote")
    return data["model"]


def _params(folder: Path, record: dict, said: str) -> dict:
    """Every parameter the checkpoint's rank files hold, by name."""
    import torch

    params = {}
    for name in record.get("names", {}):
        try:
            params.update(torch.load(folder / name, map_location="cpu", weights_only=False)["params"])
        except Exception as err:  # noqa: BLE001 - a file of the recorded size that is no checkpoint
            reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ExportFailed(f"{said}: {folder / name} cannot be read ({reason}); export an earlier "
                               f"checkpoints/step_N folder") from None
    return params


def _save_safetensors(params: dict, path: Path) -> None:
    """``params`` into ``path``; a failure to write is an OSError with its reason
    (safetensors reports a full disk as its own error)."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        save_file({k: v.contiguous() for k, v in sorted(params.items())}, str(path), metadata={"format": "pt"})
    except SafetensorError as err:
        code = re.search(r"os error (\d+)", str(err))
        if code:
            raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(path)) from None
        raise OSError(errno.EIO, str(err), str(path)) from None


def _architecture(config) -> str:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM._model_mapping[type(config)].__name__


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help") or len(args) > 2:
        print(__doc__.strip().splitlines()[-1].strip())
        return 0 if args and args[0] in ("-h", "--help") else 2
    run = Path(args[0])
    out = Path(args[1]) if len(args) > 1 else (run.parent.parent if run.name.startswith("step_") else run) / "hf"
    try:
        export_hf(run, out)
    except Fault as err:
        print(str(err), file=sys.stderr)
        return 1
    print(f"wrote {out / 'config.json'} and {out / 'model.safetensors'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
