"""Engine settings: how the KV cache is sized and how much the scheduler batches."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from producer_client.errors import InvalidArgument
from producer_client.keys import NAME_PATTERN
from producer_client.schema import invalid_argument_from


class EngineSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)  # as TomlSettings: finite numbers

    page_size: int = Field(16, ge=1, le=1024, description="tokens per KV page (and the prefix cache's granularity)")
    num_pages: int | None = Field(
        None,
        ge=1,
        description="the KV pool's size in pages; unset: sized from kv_cache_mib (CPU) or "
        "gpu_memory_utilization (CUDA)",
    )
    kv_cache_mib: int = Field(1024, ge=1, description="host memory for the KV pool on CPU")
    kv_cache_dtype: Literal["auto", "fp8_e4m3"] = Field(
        "auto",
        description="KV pages in the model's dtype (auto), or float8 e4m3 with scales: twice the tokens "
        "of a bfloat16 cache in the same memory",
    )
    gpu_memory_utilization: float = Field(
        0.85,
        gt=0.0,
        le=0.98,
        description="fraction of free GPU memory (after the weights) for the KV pool",
    )
    max_num_batched_tokens: int = Field(
        4096,
        ge=1,
        description="tokens per engine step: prefill chunks plus one per decoding job",
    )
    max_running: int = Field(256, ge=1, description="jobs in the engine at once; the worker reads no more entries")
    max_model_len: int | None = Field(
        None,
        ge=2,
        description="prompt + output tokens; unset: the model's own context length",
    )
    enable_prefix_cache: bool = Field(True, description="reuse KV pages of shared prompt prefixes (radix cache)")
    cuda_graphs: bool = Field(
        True,
        description="decode steps replay CUDA graphs captured at start (CUDA only; prefill runs eagerly)",
    )
    grammar_cache_size: int = Field(
        256,
        ge=1,
        description="structured outputs: compiled grammars kept for reuse (LRU, by the grammar's hash)",
    )
    overlap_schedule: bool | None = Field(
        None,
        description="prepare step N+1, and talk to Redis, while the device runs step N; unset: on CUDA only",
    )
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        description="ranks the model is split across, one per GPU (gloo ranks on CPU); the worker starts the other N-1",
    )
    tensor_parallel_timeout_s: float = Field(
        60.0,
        gt=0.0,
        description="from the first served step, a rank that takes part in no collective for this long (it hangs) "
        "stops the worker",
    )
    tensor_parallel_startup_timeout_s: float = Field(
        600.0,
        gt=0.0,
        description="the same bound while the ranks load and warm up, where one rank may work alone for long "
        "(compiling kernels, loading the tokenizer) while the others wait in a collective",
    )
    lora_modules: dict[str, str] = Field(
        {},
        description="LoRA adapters served by name, NAME=PATH each (a PEFT adapter directory); "
        "a job names one with adapter=NAME",
    )
    lora_dir: str | None = Field(
        None,
        description="a directory of PEFT adapters: a job naming one of its subdirectories gets that "
        "adapter, loaded on first use",
    )
    max_loras: int = Field(4, ge=1, description="LoRA adapter slots on the device: the most adapters one batch runs")
    max_cpu_loras: int | None = Field(
        None, ge=1, description="LoRA adapters kept in host memory, least recently used out first; unset: max_loras"
    )
    max_lora_rank: int = Field(
        16, ge=1, le=512, description="the largest LoRA rank served; each slot holds this rank in every projection"
    )

    speculative_method: Literal["ngram", "draft", "eagle3"] | None = Field(
        None,
        description="speculative decoding, lossless: drafts from n-gram lookup in each job's own tokens (ngram), a "
        "smaller model (draft) or an EAGLE-3 head (eagle3), verified in one step; unset: off",
    )
    num_speculative_tokens: int = Field(
        4, ge=1, le=16, description="speculative decoding: the most tokens drafted per job and step"
    )
    speculative_model: str | None = Field(
        None,
        description="speculative decoding: the draft model (draft) or the EAGLE-3 head (eagle3), a checkpoint "
        "directory or a preset",
    )

    @field_validator("lora_modules", mode="before")
    @classmethod
    def _named_paths(cls, value):
        """NAME=PATH strings (the flag's form) or a table of them (TOML, JSON)."""
        if not isinstance(value, (list, tuple)):
            return value
        pairs = [item.split("=", 1) if isinstance(item, str) else [item] for item in value]
        bad = next((item for item, pair in zip(value, pairs) if len(pair) != 2 or not all(pair)), None)
        if bad is not None:
            raise ValueError(f"{bad!r} is not NAME=PATH")
        return dict(pairs)

    @field_validator("lora_modules")
    @classmethod
    def _names_jobs_can_send(cls, value: dict[str, str]) -> dict[str, str]:
        bad = next((name for name in value if not NAME_PATTERN.fullmatch(name)), None)
        if bad is not None:
            raise ValueError(
                f"adapter name {bad!r} is not 1-128 letters, digits and ._:@/- starting with one of the first two"
            )
        return value

    @field_validator("lora_dir")
    @classmethod
    def _a_directory_this_user_reads(cls, value: str | None) -> str | None:
        """One a job's adapter can be read from: a worker given a path that is missing, a file or
        unreadable started and served none of its adapters, with an INFO line naming it."""
        if value is not None:
            check_readable_directory(Path(value).expanduser(), value)
        return value

    @property
    def serves_lora(self) -> bool:
        return bool(self.lora_modules) or self.lora_dir is not None

    @property
    def host_loras(self) -> int:
        return self.max_cpu_loras or self.max_loras

    @model_validator(mode="after")
    def _speculative_model_when_needed(self) -> EngineSettings:
        needs_model = self.speculative_method in ("draft", "eagle3")
        if needs_model and self.speculative_model is None:
            raise InvalidArgument("speculative_model", f"speculative_method {self.speculative_method} needs one")
        if not needs_model and self.speculative_model is not None:
            raise InvalidArgument("speculative_model", "only speculative_method draft or eagle3 takes one")
        return self

    @model_validator(mode="after")
    def _draft_length_only_when_drafting(self) -> EngineSettings:
        # Given without a method it was ignored: nothing drafts, so the worker ran without
        # speculation while its operator asked for K tokens of it.
        if "num_speculative_tokens" in self.model_fields_set and self.speculative_method is None:
            raise InvalidArgument(
                "num_speculative_tokens", "has no effect without speculative_method (ngram, draft or eagle3)"
            )
        return self

    @model_validator(mode="after")
    def _decodes_fit_one_step(self) -> EngineSettings:
        # Every running request decodes every step, so a step must hold one token for each.
        if self.max_running > self.max_num_batched_tokens:
            raise InvalidArgument("max_running", "must not exceed max_num_batched_tokens")
        return self

    @model_validator(mode="after")
    def _slots_fit_the_host_cache(self) -> EngineSettings:
        # An adapter read from disk waits in the host cache for a slot: a cache smaller than the
        # slots could drop it before it is installed.
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise InvalidArgument("max_cpu_loras", "must be at least max_loras")
        return self

    @classmethod
    def parse(cls, **kwargs) -> EngineSettings:
        """Build and validate, raising InvalidArgument that names the first bad setting."""
        try:
            return cls(**kwargs)
        except ValidationError as e:
            raise invalid_argument_from(e) from None


def check_readable_directory(path: Path, given: str) -> None:
    """Raises ValueError, naming `given` and why, unless `path` is a directory this process may
    list and enter."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise ValueError(f"{given!r} does not exist") from None
    except OSError as e:
        raise ValueError(f"{given!r} cannot be read: {e.strerror}") from None
    if not stat.S_ISDIR(mode):
        raise ValueError(f"{given!r} is not a directory")
    if not os.access(path, os.R_OK | os.X_OK):
        raise ValueError(f"{given!r} cannot be read: {os.strerror(errno.EACCES)}")
