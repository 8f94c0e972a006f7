"""Token embedding and LM head, with the vocabulary split across tensor-parallel ranks.

Rank r holds rows `[r * V_p, (r + 1) * V_p)` of the `[vocab, hidden]` table,
where `V_p = ceil(vocab / tp)`; rows past the real vocabulary are zero
padding. Lookup: each rank embeds the ids in its range (others -> 0) and an
all-reduce sums the partial tables (Megatron-LM's VocabParallelEmbedding).
LM head: each rank computes logits for its rows and an all-gather
concatenates them; padding columns are cut off.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.distributed.parallel_state import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)


class VocabParallelEmbedding(nn.Module):
    """Embedding table `weight [ceil(num_embeddings / tp), embedding_dim]` on each rank.

    forward: input_ids [T] int64 -> [T, embedding_dim] in the weight dtype.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, params_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.num_embeddings_per_partition = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end = min(self.vocab_start + self.num_embeddings_per_partition, num_embeddings)
        dtype = params_dtype or torch.get_default_dtype()
        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_partition, embedding_dim, dtype=dtype),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.weight.full_shape = (num_embeddings, embedding_dim)  # what weight_loader takes

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        """Copy rows [vocab_start, vocab_end) of the full `[vocab, hidden]` table; zero the padding.

        Raises:
            ValueError: the checkpoint table is not `[num_embeddings, embedding_dim]`.
        """
        if tuple(loaded_weight.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"Embedding checkpoint tensor has shape {tuple(loaded_weight.shape)}, "
                             f"expected {(self.num_embeddings, self.embedding_dim)}.")
        n = self.vocab_end - self.vocab_start
        param.data[:n].copy_(loaded_weight[self.vocab_start:self.vocab_end])
        param.data[n:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        in_range = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(in_range, input_ids - self.vocab_start, 0)
        out = F.embedding(local_ids, self.weight) * in_range.unsqueeze(-1).to(self.weight.dtype)
        return tensor_model_parallel_all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection hidden -> vocab logits, vocabulary split like the embedding.

    With tied word embeddings call `tie_weights(embed_tokens)`: the head then
    shares the embedding's parameter (no copy, no separate checkpoint tensor).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, bias: bool = False,
                 params_dtype: torch.dtype | None = None) -> None:
        super().__init__(num_embeddings, embedding_dim, params_dtype)
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.num_embeddings_per_partition, dtype=self.weight.dtype),
                                     requires_grad=False)
            self.bias.weight_loader = self._bias_loader
            self.bias.full_shape = (num_embeddings,)
        else:
            self.register_parameter("bias", None)
        # CPU bfloat16: the weight in oneDNN's packed layout (`layers/cpu_weights.py`), else None.
        self.packed_weight: torch.Tensor | None = None
        # CPU GGUF: the head's weight kept as ggml blocks (`layers/gguf_weights.GGUFWeight`), else None.
        self.gguf_weight = None

    def _bias_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        n = self.vocab_end - self.vocab_start
        param.data[:n].copy_(loaded_weight[self.vocab_start:self.vocab_end])
        param.data[n:].zero_()

    def tie_weights(self, embed_tokens: VocabParallelEmbedding) -> None:
        """Share `embed_tokens.weight` as this head's weight."""
        self.weight = embed_tokens.weight

    def compute_logits(self, hidden_states: torch.Tensor, soft_cap: float | None = None) -> torch.Tensor:
        """hidden_states [N, H] -> logits [N, num_embeddings] float32 (full vocab on every rank).

        `soft_cap`: Gemma-2 final-logit soft-capping `cap * tanh(logits / cap)`.
        """
        if self.gguf_weight is not None:
            logits = self.gguf_weight.matmul(hidden_states, self.bias)
        elif self.packed_weight is not None:
            logits = torch.ops.mkldnn._linear_pointwise(hidden_states, self.packed_weight, self.bias, "none", [], "")
        else:
            logits = F.linear(hidden_states, self.weight, self.bias)
        logits = tensor_model_parallel_all_gather(logits, dim=-1)[..., : self.num_embeddings].float()
        if soft_cap is not None:
            logits = soft_cap * torch.tanh(logits / soft_cap)
        return logits

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead is not called directly; use compute_logits(hidden_states).")
