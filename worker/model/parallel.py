"""Tensor parallelism as the model sees it: which share of each split dimension this rank holds,
and the collectives the split layers need.

The split is Megatron-LM's, as vLLM and SGLang make it: q/k/v and gate/up are column-parallel
(each rank holds some heads, some intermediate rows), o_proj and down_proj row-parallel (the
matching input columns), so each block's output is a partial sum that one all-reduce completes.
A mixture of experts splits every expert alike along its intermediate rows. The embedding and
the LM head are split over the vocabulary: a token's row lives on one rank (the others add
zeros), and the logits' columns are gathered on rank 0, the only rank that samples.

KV heads split as the query heads do when their count divides by the ranks; when the ranks
outnumber them (their count divides the ranks), each rank holds the one KV head its query
heads read, replicated. Other shapes are refused before any process starts.

A collective that fails (a peer died: gloo notices a closed connection at once) or times out
(a peer hangs) raises RankFailed: no job is to blame, so it is not an Exception a job-level
handler could catch; the worker stops and other workers reclaim its jobs.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from producer_client.errors import InvalidArgument
from worker.model.config import Qwen3Config
from worker.model.rank_failed import RankFailed


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in the group; `group` is None for a single rank (every collective is then a no-op)."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None
    device: torch.device = torch.device("cpu")  # NCCL reduces tensors on the rank's GPU only

    # -- shares -----------------------------------------------------------------------------

    def split(self, count: int) -> range:
        """This rank's share of `count` units that divide evenly (query heads, intermediate rows)."""
        share = count // self.size
        return range(self.rank * share, (self.rank + 1) * share)

    def kv_heads(self, num_kv_heads: int) -> range:
        """Split like the query heads, or the one head this rank's query heads read."""
        if num_kv_heads % self.size == 0:
            return self.split(num_kv_heads)
        head = self.rank * num_kv_heads // self.size
        return range(head, head + 1)

    def vocab_rows(self, vocab_size: int) -> int:
        """Rows of the embedding and the LM head per rank: the last rank's tail is zero padding
        when the vocabulary does not divide evenly."""
        return -(-vocab_size // self.size)

    def vocab(self, vocab_size: int) -> range:
        """The token ids this rank's embedding rows hold."""
        rows = self.vocab_rows(vocab_size)
        return range(min(self.rank * rows, vocab_size), min((self.rank + 1) * rows, vocab_size))

    # -- collectives ------------------------------------------------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's x, in place."""
        if self.group is not None:
            self._wait(self.group.allreduce([x]), "all-reduce")
        return x

    def min(self, value: int) -> int:
        """The least of every rank's value (what each rank's memory allows, agreed)."""
        if self.group is None:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self._wait(self.group.allreduce([t], opts), "all-reduce")
        return int(t.item())

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x on every rank, in place."""
        if self.group is not None:
            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            self._wait(self.group.broadcast([x], opts), "broadcast")
        return x

    def gather_vocab(self, local: torch.Tensor, vocab_size: int, out: torch.Tensor | None) -> torch.Tensor | None:
        """Each rank's logits columns [N, vocab_rows] -> on rank 0 the whole [N, vocab_size]
        (written into `out` when given); None on the other ranks."""
        if self.group is None:
            return local if out is None else out.copy_(local)
        opts = dist.GatherOptions()
        opts.rootRank = 0
        parts = [torch.empty_like(local) for _ in range(self.size)] if self.rank == 0 else []
        self._wait(self.group.gather([parts] if parts else [], [local], opts), "gather")
        if self.rank != 0:
            return None
        if out is None:
            out = torch.empty(local.shape[0], vocab_size, dtype=local.dtype, device=local.device)
        width = local.shape[1]
        for rank, part in enumerate(parts):
            start = rank * width
            end = min(start + width, vocab_size)
            out[:, start:end] = part[:, : end - start]
        return out

    def set_timeout(self, timeout_s: float) -> None:
        """This rank's collectives from now on wait at most timeout_s for a peer (gloo and NCCL).
        torch sets a group's timeout publicly only when it makes the group; its own
        dist.breakpoint changes it after with this same function."""
        if self.group is not None:
            dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=timeout_s), self.group)

    def _wait(self, work: dist.Work, what: str) -> None:
        try:
            work.wait()
        except RuntimeError as e:  # gloo: a peer closed its connection, or the group's timeout passed
            raise RankFailed(f"tensor-parallel rank {self.rank}: {what} failed: {e}") from None


SINGLE = TensorParallel()


def check_shapes(config: Qwen3Config, size: int) -> None:
    """InvalidArgument naming tensor_parallel_size unless every split dimension of `config`
    divides over `size` ranks (the dense MLP's rows where a layer has one, the experts' where
    one has experts)."""
    if size == 1:
        return
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    problems = []
    if heads % size:
        problems.append(f"does not divide num_attention_heads {heads}")
    elif kv % size and size % kv:
        problems.append(f"neither divides nor is a multiple of num_key_value_heads {kv}")
    sparse = [config.is_moe_layer(layer) for layer in range(config.num_hidden_layers)]
    mlps = {"intermediate_size": not all(sparse), "moe_intermediate_size": any(sparse)}
    for field, used in mlps.items():
        if used and getattr(config, field) % size:
            problems.append(f"does not divide {field} {getattr(config, field)}")
    if problems:
        raise InvalidArgument("tensor_parallel_size", f"{size} {'; '.join(problems)}")
