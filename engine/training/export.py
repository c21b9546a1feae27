"""``pipecast export CHECKPOINT --out model.safetensors [--dtype fp32|bf16|fp16]``: the consolidated model of a
checkpoint (any pipeline layout) as one ``safetensors`` file, with ``<stem>.config.json`` beside it (the model
settings, tokenizer kind, step and source checkpoint; also in the file's metadata) and, for BPE runs,
``<stem>.tokenizer.json``.

Tensor names are the layout-independent checkpoint names (``layers.<i>.*``, ``embedding.word.weight`` -- also the
output head when tied --, ``embedding.pos.weight``, ``final_norm.*``).  Every file is written under a temporary
name and renamed when complete, so a failed export leaves nothing half-written.  Load with
:func:`load_exported` (or ``safetensors.torch.load_file``).

``--format hf --out DIR``: a Hugging Face folder instead (``config.json``, ``model.safetensors`` and, for BPE runs,
``tokenizer.json`` + ``tokenizer_config.json``) that ``transformers.AutoModelForCausalLM.from_pretrained(DIR)``
loads as the family's Hugging Face architecture (:mod:`engine.training.checkpoint.hf`; ``transformers`` is not
needed to write it).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
from pathlib import Path

from .files import WriteError, check_folder, write_atomically, writing

__all__ = ["add_arguments", "run", "export_checkpoint", "export_hf", "load_exported", "DTYPES", "FORMATS"]

DTYPES = ("fp32", "bf16", "fp16")
FORMATS = ("safetensors", "hf")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", metavar="CHECKPOINT",
                        help="a checkpoint folder (step_XXXXXXXX) or a run folder (its latest checkpoint)")
    parser.add_argument("--out", required=True, help="the .safetensors file to write (e.g. model.safetensors); "
                        "with --format hf the folder to write")
    parser.add_argument("--format", choices=FORMATS, default="safetensors",
                        help="safetensors: pipecast's tensor names in one file (default); hf: a Hugging Face folder "
                             "(config.json, model.safetensors, tokenizer files) for transformers' from_pretrained")
    parser.add_argument("--dtype", choices=DTYPES, default="fp32",
                        help="tensor dtype in the file (default fp32, the training dtype: bitwise the checkpoint)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace what --out holds: an existing file and its sidecars, or (--format hf) a folder "
                             "with files in it, which then holds the new files only (refused without it)")


def _sidecars(out: Path) -> tuple[Path, Path]:
    return out.with_name(out.stem + ".config.json"), out.with_name(out.stem + ".tokenizer.json")


def export_checkpoint(checkpoint, out, dtype: str = "fp32", overwrite: bool = False) -> list[Path]:
    """Write the model of ``checkpoint`` to ``out`` (+ sidecars); returns the paths written.  ``out`` or a sidecar
    that exists is refused unless ``overwrite``; then the new files replace them and a sidecar of the earlier
    export that this one does not write (a tokenizer) is removed.

    Raises:
        CheckpointError: no / unreadable checkpoint. ValueError: ``out`` is not a ``.safetensors`` path in an
            existing folder, ``out`` is a folder, ``out`` or a sidecar exists without ``overwrite``, or an unknown
            ``dtype``.  WriteError (an ``OSError``): a file could not be written (read-only or full disk, no
            permission), naming it and the operating system's reason; no file is left half-written.
    """
    import torch
    from safetensors.torch import save_file
    from .generate import load_model, model_state_dict
    out = Path(out)
    if out.suffix != ".safetensors":
        raise ValueError(f"--out={str(out)!r} must end in .safetensors (e.g. model.safetensors)")
    if not out.parent.is_dir():
        raise ValueError(f"--out={str(out)!r}: folder {str(out.parent)!r} does not exist; create it first")
    if out.is_dir():
        raise ValueError(f"--out={str(out)!r} is a folder; name the file to write, e.g. {str(out / 'model.safetensors')!r}")
    if dtype not in DTYPES:
        raise ValueError(f"--dtype={dtype!r} is not one of {', '.join(DTYPES)}")
    there = [p for p in (out, *_sidecars(out)) if p.exists()]
    if there and not overwrite:
        raise ValueError(f"--out={str(out)!r}: {', '.join(repr(str(p)) for p in there)} already exist"
                         f"{'s' if len(there) == 1 else ''} (an earlier export); pass --overwrite to replace "
                         f"{'it' if len(there) == 1 else 'them'} or choose another --out")
    loaded = load_model(checkpoint)
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    tensors = {k: v.detach().to(torch_dtype).contiguous() for k, v in model_state_dict(loaded.model).items()}
    config_path, tok_path = _sidecars(out)
    info = {"model": dataclasses.asdict(loaded.config) | {"ffn_hidden_size": loaded.config.ffn_hidden_size or
                                               4 * loaded.config.hidden_size},
            "tokenizer": getattr(loaded.tokenizer, "kind", "none"), "dtype": dtype, "step": loaded.step,
            "checkpoint": str(loaded.checkpoint)}
    writes = [(out, lambda p: save_file(tensors, str(p), metadata={"format": "pt", "pipecast": json.dumps(info)})),
              (config_path, lambda p: p.write_text(json.dumps(info, indent=1, sort_keys=True) + "\n"))]
    if getattr(loaded.tokenizer, "kind", None) == "bpe":
        writes.append((tok_path, lambda p: shutil.copyfile(loaded.checkpoint / "tokenizer.json", p)))
    written = write_atomically(writes)
    for stale in set(there) - set(written):  # --overwrite: the earlier export's tokenizer, not this one's
        with writing(stale, "--out"):
            stale.unlink(missing_ok=True)
    return written


def export_hf(checkpoint, out, dtype: str = "fp32", overwrite: bool = False) -> list[Path]:
    """Write the model of ``checkpoint`` as a Hugging Face folder ``out``; returns the paths written.  A folder
    that holds files is refused unless ``overwrite``; then it is replaced whole
    (:func:`engine.training.checkpoint.hf.write_hf_folder`).

    Raises:
        CheckpointError: no / unreadable checkpoint. ValueError: ``out``'s parent folder is missing, ``out`` is a
            file or holds files without ``overwrite``, or an unknown ``dtype``.  WriteError: as
            :func:`export_checkpoint`.
    """
    from .generate import load_model, model_state_dict
    from .checkpoint.hf import write_hf_folder
    if dtype not in DTYPES:
        raise ValueError(f"--dtype={dtype!r} is not one of {', '.join(DTYPES)}")
    if Path(out).exists() and not Path(out).is_dir():
        raise ValueError(f"--out={str(out)!r} is a file; --format hf writes a folder")
    check_folder(out, overwrite=overwrite)  # before the checkpoint is read
    loaded = load_model(checkpoint)
    cfg = loaded.config
    tokenizer_json = None
    if getattr(loaded.tokenizer, "kind", None) == "bpe":
        tokenizer_json = (loaded.checkpoint / "tokenizer.json").read_text()
    hf_dtype = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[dtype]
    return write_hf_folder(out, cfg, cfg.ffn_hidden_size or 4 * cfg.hidden_size, model_state_dict(loaded.model),
                           hf_dtype, tokenizer_json, overwrite)


def load_exported(path) -> tuple[dict, dict]:
    """``(tensors, info)`` of an exported file: the state dict and the settings stored with it."""
    from safetensors import safe_open
    from safetensors.torch import load_file
    with safe_open(str(path), framework="pt") as fh:
        info = json.loads(fh.metadata()["pipecast"])
    return load_file(str(path)), info


def run(args: argparse.Namespace) -> int:
    """Entry point of ``pipecast export``; 0 ok, 2 bad input (one ``error:`` line, nothing written)."""
    from .checkpoint.dcp import CheckpointError
    try:
        export = export_hf if getattr(args, "format", "safetensors") == "hf" else export_checkpoint
        written = export(args.checkpoint, args.out, args.dtype, getattr(args, "overwrite", False))
    except (CheckpointError, ValueError, WriteError) as exc:  # WriteError: an OSError naming path and reason
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print("wrote " + ", ".join(str(p) for p in written), file=sys.stderr)
    return 0
