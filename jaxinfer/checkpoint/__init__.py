"""Checkpoint sources: a GGUF file, an HF safetensors directory, or an orbax directory we wrote."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jaxinfer.checkpoint.assemble import CheckpointError


def open_checkpoint(path: str | Path) -> Any:
    """The checkpoint object for `path`, chosen by what is on disk."""
    from jaxinfer.checkpoint.gguf import GGUFCheckpoint
    from jaxinfer.checkpoint.orbax import ORBAX_MARKER, OrbaxCheckpoint
    from jaxinfer.checkpoint.safetensors import SafetensorsCheckpoint

    p = Path(path).expanduser()
    if p.is_file():
        if p.suffix != ".gguf":
            raise CheckpointError(f"{p}: model files must be .gguf; for safetensors pass the directory.")
        return GGUFCheckpoint(p)
    if not p.is_dir():
        raise CheckpointError(f"{p}: no such file or directory (models are local paths, bundled aliases or "
                              "presets; nothing is downloaded).")
    if (p / ORBAX_MARKER).is_file():
        return OrbaxCheckpoint(p)
    if (p / "config.json").is_file():
        return SafetensorsCheckpoint(p)
    ggufs = sorted(p.glob("*.gguf"))
    if len(ggufs) == 1:
        return GGUFCheckpoint(ggufs[0])
    raise CheckpointError(
        f"{p}: not a checkpoint directory (expected config.json + *.safetensors, an orbax checkpoint "
        f"written by `jaxinfer convert`, or a single .gguf file)."
    )


__all__ = ["CheckpointError", "open_checkpoint"]
