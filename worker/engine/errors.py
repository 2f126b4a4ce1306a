"""Engine errors. Their codes reach failed job results, so a client can branch on them."""

from producer_client.errors import InvalidArgument, MiliError


class PromptTooLong(InvalidArgument):
    """The prompt leaves no room for output within max_model_len."""

    code = "prompt_too_long"


class KVCapacityExceeded(MiliError):
    """The request needs more KV pages than the whole pool holds, so it can never run."""

    code = "kv_capacity_exceeded"


class NonFiniteLogits(MiliError):
    """The model produced a NaN or an infinity in the request's logits, so no token can be drawn."""

    code = "nonfinite_logits"


class KVCacheTooSmall(MiliError):
    """The configured KV memory does not hold a single page."""

    code = "kv_cache_too_small"


class OutOfPages(MiliError):
    """More pages were asked for than are free. The scheduler checks first, so this is a bug."""

    code = "out_of_pages"


class StructuredOutputError(MiliError):
    """The request's grammar refused the token drawn under its own mask, or left no token to
    draw: a schema whose contradiction the compiler did not see. Nothing valid can follow."""

    code = "structured_output_error"
