"""Qwen3-MoE's sparse MLP: a router sends each token to its top-k experts, and the experts' SwiGLU
MLPs run as one grouped computation over every (token, expert) pair (kernels.fused_moe).

Numerics follow transformers' Qwen3MoeSparseMoeBlock: router logits in the weights' dtype,
softmax in float32, top-k, renormalized over the k when norm_topk_prob, the routing weights
cast back to the activations' dtype; a token's output is the weighted sum of its experts'.

Expert weights are stacked per layer, in transformers' own names and layout:
experts.gate_up_proj [E, 2 * moe_intermediate_size, hidden] holds each expert's gate rows, then
its up rows (as the dense layers' gate_up_proj does), experts.down_proj [E, hidden,
moe_intermediate_size]. Checkpoints store a tensor per expert and projection, which the loader
copies into the stacks. Under tensor parallelism every expert is split alike along its
intermediate rows (each rank holds its share of each expert's gate rows, up rows and down
columns), the router is whole on every rank, and the experts' partial sums are all-reduced.
"""

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from kernels.fused_moe import warm_up_token_counts
from worker.model.batch import LoraBatch
from worker.model.config import Qwen3MoeConfig
from worker.model.parallel import TensorParallel
from worker.model.params import empty_weight


class Router(nn.Module):
    def __init__(self, config: Qwen3MoeConfig, dtype: torch.dtype):
        super().__init__()
        self.weight = empty_weight(config.num_experts, config.hidden_size, dtype=dtype)
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (routing weights [T, k] in x's dtype, expert ids [T, k] int64)."""
        probs = torch.softmax(F.linear(x, self.weight), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts


class Experts(nn.Module):
    def __init__(self, config: Qwen3MoeConfig, dtype: torch.dtype, tp: TensorParallel):
        super().__init__()
        num, hidden, inter = config.num_experts, config.hidden_size, len(tp.split(config.moe_intermediate_size))
        self.gate_up_proj = empty_weight(num, 2 * inter, hidden, dtype=dtype)
        self.down_proj = empty_weight(num, hidden, inter, dtype=dtype)


class Qwen3MoeSparseBlock(nn.Module):
    def __init__(self, config: Qwen3MoeConfig, dtype: torch.dtype, tp: TensorParallel):
        super().__init__()
        self.gate = Router(config, dtype)  # transformers' name for the router: mlp.gate.weight
        self.experts = Experts(config, dtype, tp)
        self.tp = tp

    def forward(self, x: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:
        """`lora` is the dense MLP's argument: experts take no adapter (one that targets them is
        refused when it loads, worker/model/lora_adapter.py)."""
        return self.tp.all_reduce(self._local_experts(x))

    def _local_experts(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of every expert's output (the whole of it on one rank)."""
        weights, experts = self.gate(x)
        return kernels.fused_moe(x, self.experts.gate_up_proj, self.experts.down_proj, weights, experts)

    @torch.inference_mode()
    def warm_up(self, max_tokens: int) -> None:
        """Runs once at each kernel tile shape a step of up to max_tokens tokens picks (kernels/fused_moe.py
        chooses larger blocks of pairs for larger steps), so that none compiles while serving. Each
        rank warms its own share up, without the all-reduce: no collective, so no rank waits on another."""
        weight = self.gate.weight
        for tokens in warm_up_token_counts(max_tokens, self.gate.top_k, weight.shape[0], weight.dtype):
            self._local_experts(torch.zeros(tokens, weight.shape[1], dtype=weight.dtype, device=weight.device))
