"""A checkpoint's errors, free of torch: a worker refuses a --model that names nothing before it
imports torch and the kernels (worker.model.names)."""

from producer_client.errors import MiliError


class CheckpointError(MiliError):
    """A checkpoint directory is incomplete or inconsistent; the message names the file or tensor."""

    code = "checkpoint_error"


class UnsupportedModel(CheckpointError):
    """A well-formed checkpoint of a model or feature this worker does not implement."""

    code = "unsupported_model"
