"""Structured outputs' token masks applied to the logits: one launch for a batch.

A bitmask row is int32 words, bit b of word w standing for token 32 * w + b (llguidance's and
xgrammar's layout); a token whose bit is 0 gets a logit of -inf, so neither the argmax nor a
draw can pick it. Row i of the mask applies to logits row `logit_rows[i]` and is read from
bitmask row `mask_rows[i]`: the constrained rows of a batch are masked in place, the others
left as they are, and on CPU the worker's mask table is read where it lies, without a gather.

On CPU a numba kernel does the work: it skips a word whose 32 tokens are all allowed and, since
most of a constrained vocabulary is forbidden, writes the rest as runs of -inf. One thread: a row
is a memory-bound 40 us or so of stores (Qwen3's vocabulary), and on the shared 2-core test VM
numba's thread pool cost more to wake than it saved (bench/RESULTS.md, "Structured outputs"). Triton elsewhere
(and under TRITON_INTERPRET=1); the torch reference is the specification.
"""

import numba
import numpy as np
import torch
import triton
import triton.language as tl

from kernels._dispatch import use_triton

BITS = 32


def words_for(vocab: int) -> int:
    """int32 words of a bitmask row over `vocab` tokens."""
    return (vocab + BITS - 1) // BITS


def apply_token_bitmask_reference(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    logit_rows: torch.Tensor,
    mask_rows: torch.Tensor,
) -> None:
    """logits [N, V] float, in place; bitmask [M, W] int32; logit_rows, mask_rows [R] int64."""
    vocab = logits.shape[1]
    shifts = torch.arange(BITS, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask[mask_rows][:, :, None] >> shifts) & 1
    allowed = bits.flatten(1)[:, :vocab].bool()
    if allowed.shape[1] < vocab:  # tokens past the mask's words are not allowed
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    logits[logit_rows] = logits[logit_rows].masked_fill(~allowed, float("-inf"))


@triton.jit
def _apply_token_bitmask_kernel(
    logits_ptr,
    logits_stride,
    bitmask_ptr,
    bitmask_stride,
    bitmask_words,
    logit_rows_ptr,
    mask_rows_ptr,
    vocab,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    row = tl.load(logit_rows_ptr + i).to(tl.int64)
    mask_row = tl.load(mask_rows_ptr + i).to(tl.int64)
    tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = tokens < vocab
    word_index = tokens // 32
    words = tl.load(
        bitmask_ptr + mask_row * bitmask_stride + word_index,
        mask=in_vocab & (word_index < bitmask_words),
        other=0,
    )
    allowed = (words >> (tokens % 32)) & 1
    tl.store(logits_ptr + row * logits_stride + tokens, float("-inf"), mask=in_vocab & (allowed == 0))


def apply_token_bitmask_triton(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    logit_rows: torch.Tensor,
    mask_rows: torch.Tensor,
) -> None:
    rows, vocab = logit_rows.shape[0], logits.shape[1]
    if rows == 0:
        return
    assert logits.stride(1) == 1 and bitmask.stride(1) == 1
    block = 1024
    _apply_token_bitmask_kernel[(rows, triton.cdiv(vocab, block))](
        logits,
        logits.stride(0),
        bitmask,
        bitmask.stride(0),
        bitmask.shape[1],
        logit_rows,
        mask_rows,
        vocab,
        BLOCK=block,
        num_warps=4,
    )


@numba.njit(cache=True, nogil=True)
def _apply_rows(logits, bitmask, logit_rows, mask_rows):  # pragma: no cover - compiled
    vocab = logits.shape[1]
    minus_inf = np.float32(-np.inf)
    for i in range(logit_rows.size):
        row = logits[logit_rows[i]]
        words = bitmask[mask_rows[i]]
        for w in range(min(words.size, (vocab + 31) // 32)):
            word = words[w]
            if word == -1:
                continue
            base = w * 32
            end = min(base + 32, vocab)
            if word == 0:  # the common case: a whole word forbidden, a run of stores that vectorizes
                row[base:end] = minus_inf
                continue
            for t in range(base, end):
                if (word >> (t - base)) & 1 == 0:
                    row[t] = minus_inf
        row[words.size * 32 :] = minus_inf


def apply_token_bitmask_cpu(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    logit_rows: torch.Tensor,
    mask_rows: torch.Tensor,
) -> None:
    _apply_rows(logits.numpy(), bitmask.numpy(), logit_rows.numpy(), mask_rows.numpy())


def supports_cpu(logits: torch.Tensor) -> bool:
    return logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous()


def apply_token_bitmask(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    logit_rows: torch.Tensor,
    mask_rows: torch.Tensor,
) -> None:
    """Sets to -inf, in place, every logit whose token the bitmask forbids (see the module)."""
    if use_triton(logits):
        apply_token_bitmask_triton(logits, bitmask, logit_rows, mask_rows)
    elif supports_cpu(logits):
        apply_token_bitmask_cpu(logits, bitmask, logit_rows, mask_rows)
    else:
        apply_token_bitmask_reference(logits, bitmask, logit_rows, mask_rows)
