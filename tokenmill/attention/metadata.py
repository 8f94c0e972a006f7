"""AttentionMetadata: the per-step batch description every attention backend reads.

Built once per step by the model runner; tensors live on the model's device.
A step mixes prefill chunks and decodes; each request i contributes
`query_start_loc[i+1] - query_start_loc[i]` new tokens (its "query"), which
attend to the first `seq_lens[i]` tokens of that request (cached + new):

    request i:  | cached (context_lens[i]) | new (query_lens[i]) |
                |<-------------- seq_lens[i] ------------------>|

Causality inside the chunk: new token j (0-based within the chunk) sees
context positions [0, context_lens[i] + j].
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(slots=True)
class AttentionMetadata:
    num_actual_tokens: int  # tokens in the step, before any padding
    num_reqs: int
    max_query_len: int
    max_seq_len: int
    # [num_reqs + 1] int32: exclusive prefix sum of query lengths. [3, 1, 1] -> [0, 3, 4, 5]
    query_start_loc: torch.Tensor
    # [num_reqs] int32: tokens each request attends to after this step.
    seq_lens: torch.Tensor
    # [num_reqs, max_num_blocks_per_req] int32: block ids; unused entries are 0.
    block_table: torch.Tensor
    # [num_tokens] int64: cache slot of each new token; -1 = padding, not written.
    slot_mapping: torch.Tensor
    # Host copies (NumPy) for backends that loop over requests without a device sync.
    query_start_loc_cpu: np.ndarray
    seq_lens_cpu: np.ndarray
