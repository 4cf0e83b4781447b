"""Batch job configuration: YAML or gin, every section validated, unknown keys rejected by name.

```yaml
model: <path | alias>
input:  {path: prompts.jsonl, prompt_field: prompt, id_field: id}   # or messages_field: messages (chat)
output: {path: out.jsonl}   # error_path: defaults to out.errors.jsonl beside it
sampling: {max_tokens: 128, temperature: 0.7, seed: 0}               # any SamplingParams field
engine: {max_num_seqs: 64, dtype: bfloat16, tensor_parallel_size: 1}  # any LLM(...) argument
```
Relative paths are relative to the current directory. The gin form binds the same sections as arguments
of the configurable `batch_job` (see configs/jobs/quickstart.gin). Every section is checked when the job
loads, before the model: `sampling` by SamplingParams' table, `engine` by the same check as LLM(...)
(jaxinfer.llm_args), so a job fails in a second with one line naming the key, not after loading a model.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import gin

from jaxinfer.config import ConfigError, SamplingParams, FromDict, load_yaml
from jaxinfer.llm_args import resolve_llm_args


@dataclasses.dataclass(frozen=True, kw_only=True)
class InputConfig(FromDict):
    path: str
    id_field: str = "id"
    prompt_field: str | None = "prompt"
    messages_field: str | None = None  # chat records: a list of {role, content}, rendered with the template
    sampling_field: str = "sampling"  # optional per-record SamplingParams overrides

    def __post_init__(self) -> None:
        if self.messages_field is not None:
            object.__setattr__(self, "prompt_field", None)


@dataclasses.dataclass(frozen=True, kw_only=True)
class OutputConfig(FromDict):
    path: str
    # Records that fail (validation or generation) go here with their id and message, and count as done on
    # resume. None: <path without .jsonl>.errors.jsonl.
    error_path: str | None = None

    @property
    def errors(self) -> str:
        if self.error_path is not None:
            return self.error_path
        path = Path(self.path)
        return str(path.with_name(f"{path.stem}.errors{path.suffix or '.jsonl'}"))


# Engine defaults of batch jobs where they differ from LLM(...)'s (kept from before the vLLM names).
ENGINE_DEFAULTS: dict[str, Any] = {"dtype": "float32", "max_num_batched_tokens": 256}


@dataclasses.dataclass(frozen=True, kw_only=True)
class BatchJob(FromDict):
    model: str
    input: InputConfig
    output: OutputConfig
    sampling: dict[str, Any] = dataclasses.field(default_factory=dict)
    engine: dict[str, Any] = dataclasses.field(default_factory=dict)  # LLM(...) keyword arguments
    max_in_flight: int = 256  # requests queued in the engine at once; bounds memory on huge inputs

    def __post_init__(self) -> None:
        if self.max_in_flight < 1:
            raise ConfigError(f"job.max_in_flight must be >= 1, got {self.max_in_flight}.")

    @property
    def base_sampling(self) -> SamplingParams:
        return SamplingParams.from_dict(self.sampling, section="sampling")

    @property
    def llm_kwargs(self) -> dict[str, Any]:
        return {**ENGINE_DEFAULTS, **self.engine}


_SECTIONS = {"input": InputConfig, "output": OutputConfig}


def job_from_dict(data: dict[str, Any], source: str) -> BatchJob:
    """Validate every section; errors name the file and the offending key."""
    try:
        if not isinstance(data, dict):
            raise ConfigError(f"expected a mapping of job sections, got {type(data).__name__}.")
        top = dict(data)
        for name, cls in _SECTIONS.items():
            if name in top:
                top[name] = cls.from_dict({} if top[name] is None else top[name], section=name)
        top["engine"] = {} if top.get("engine") is None else top["engine"]
        job = BatchJob.from_dict(top, section="job")
        job.base_sampling  # noqa: B018 - validates the sampling section now, not after the model loaded
        resolve_llm_args(job.llm_kwargs, where="engine.")
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
