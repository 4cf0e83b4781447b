"""Batch job configuration: YAML or gin, every section validated, unknown keys rejected by name.

```yaml
model: <path | alias>
input:  {path: prompts.jsonl, prompt_field: prompt, id_field: id}   # or messages_field: messages (chat)
output: {path: out.jsonl}
sampling: {max_tokens: 128, temperature: 0.7, seed: 0}               # any SamplingParams field
engine: {max_num_seqs: 64, dtype: bfloat16, tensor_parallel_size: 1}  # any engine field
```
Relative paths are relative to the current directory. The gin form binds the same sections as arguments
of the configurable `batch_job` (see configs/jobs/quickstart.gin).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import gin

from jaxinfer.config import ConfigError, SamplingParams, _FromDict, load_yaml


@dataclasses.dataclass(frozen=True, kw_only=True)
class InputConfig(_FromDict):
    path: str
    id_field: str = "id"
    prompt_field: str | None = "prompt"
    messages_field: str | None = None  # chat records: a list of {role, content}, rendered with the template
    sampling_field: str = "sampling"  # optional per-record SamplingParams overrides

    def __post_init__(self) -> None:
        if self.messages_field is not None:
            object.__setattr__(self, "prompt_field", None)


@dataclasses.dataclass(frozen=True, kw_only=True)
class OutputConfig(_FromDict):
    path: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineArgs(_FromDict):
    """The `LLM(...)` keyword arguments a job may set."""

    dtype: str = "float32"
    tensor_parallel_size: int = 1
    max_model_len: int | None = None
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 256
    decode_steps_per_call: int = 1
    overlap_decode: bool = True
    compilation_cache_dir: str | None = "auto"
    page_size: int = 16
    num_pages: int | None = None
    memory_fraction: float = 0.5
    enable_prefix_caching: bool = True
    attention_impl: str = "auto"
    interpret: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class BatchJob(_FromDict):
    model: str
    input: InputConfig
    output: OutputConfig
    sampling: dict[str, Any] = dataclasses.field(default_factory=dict)
    engine: EngineArgs = dataclasses.field(default_factory=EngineArgs)
    max_in_flight: int = 256  # requests queued in the engine at once; bounds memory on huge inputs

    @property
    def base_sampling(self) -> SamplingParams:
        return SamplingParams.from_dict(self.sampling, section="sampling")


_SECTIONS = {"input": InputConfig, "output": OutputConfig, "engine": EngineArgs}


def job_from_dict(data: dict[str, Any], source: str) -> BatchJob:
    """Validate every section; errors name the file and the offending key."""
    try:
        top = dict(data)
        for name, cls in _SECTIONS.items():
            if name in top:
                top[name] = cls.from_dict(top[name] or {}, section=name)
        job = BatchJob.from_dict(top, section="job")
        job.base_sampling  # noqa: B018 - validates the sampling section now, not after the model loaded
        return job
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    except TypeError as e:  # a missing required key
        raise ConfigError(f"{source}: {e}") from None


def load_job(path: str | Path) -> BatchJob:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such job file.")
    if path.suffix in (".yaml", ".yml"):
        return job_from_dict(load_yaml(path), str(path))
    if path.suffix == ".gin":
        return job_from_dict(_gin_sections(path), str(path))
    raise ConfigError(f"{path}: job files must end in .yaml, .yml or .gin.")


@gin.configurable("batch_job")
def gin_batch_job(
    model: str = gin.REQUIRED,
    input: dict = gin.REQUIRED,  # noqa: A002 - the section's name in the YAML form
    output: dict = gin.REQUIRED,
    sampling: dict | None = None,
    engine: dict | None = None,
) -> dict[str, Any]:
    """The gin form of a job: the same sections as the YAML form, bound as arguments."""
    sections = {"model": model, "input": dict(input), "output": dict(output)}
    if sampling is not None:
        sections["sampling"] = dict(sampling)
    if engine is not None:
        sections["engine"] = dict(engine)
    return sections


def _gin_sections(path: Path) -> dict[str, Any]:
    gin.clear_config()
    try:
        gin.parse_config_file(str(path))
        return gin_batch_job()
    except (ValueError, KeyError) as e:
        raise ConfigError(f"{path}: {e}") from None
    finally:
        gin.clear_config()
