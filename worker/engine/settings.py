"""Engine settings: how the KV cache is sized and how much the scheduler batches."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from producer_client.errors import InvalidArgument
from producer_client.schema import invalid_argument_from


class EngineSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    page_size: int = Field(16, ge=1, le=1024)  # tokens per KV page (and radix-cache granularity)
    num_pages: int | None = Field(None, ge=1)  # explicit pool size; otherwise sized from memory below
    kv_cache_mib: int = Field(1024, ge=1)  # host memory for the pool on CPU
    gpu_memory_utilization: float = Field(0.85, gt=0.0, le=0.98)  # of free GPU memory after loading weights
    max_num_batched_tokens: int = Field(4096, ge=1)  # tokens per step (prefill chunks + decodes)
    max_running: int = Field(256, ge=1)  # requests decoding at once
    max_model_len: int | None = Field(None, ge=2)  # prompt + output; default: the model's context
    enable_prefix_cache: bool = True
    cuda_graphs: bool = True  # decode steps replay CUDA graphs captured at start (CUDA devices only)
    overlap_schedule: bool | None = None  # prepare step N+1 while the device runs step N; unset: on CUDA only

    @model_validator(mode="after")
    def _decodes_fit_one_step(self) -> "EngineSettings":
        # Every running request decodes every step, so a step must hold one token for each.
        if self.max_running > self.max_num_batched_tokens:
            raise InvalidArgument("max_running", "must not exceed max_num_batched_tokens")
        return self

    @classmethod
    def parse(cls, **kwargs) -> "EngineSettings":
        """Build and validate, raising InvalidArgument that names the first bad setting."""
        try:
            return cls(**kwargs)
        except ValidationError as e:
            raise invalid_argument_from(e) from None
