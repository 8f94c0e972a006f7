"""n > 1: one user request becomes n engine-core requests (vLLM's parallel sampling).

Child i has id f"{i}_{parent_id}" and a clone of the params with n = 1; when
the parent has a seed, child i uses seed + i, so the n completions differ but
the whole set is reproducible. `OutputProcessor` gathers the children's
outputs under the parent id (`CompletionOutput.index` = i).
"""

from __future__ import annotations

import dataclasses

from tokenmill.engine.messages import EngineCoreRequest
from tokenmill.frontend.output_processor import ParentRequest


def child_request_id(index: int, parent_id: str) -> str:
    return f"{index}_{parent_id}"


def make_child_requests(request: EngineCoreRequest) -> tuple[ParentRequest | None, list[EngineCoreRequest]]:
    """Split a processed request by its `sampling_params.n`.

    Returns:
        (None, [request]) when n == 1; else (the ParentRequest, the n children
        in index order). Pass child i to `OutputProcessor.add_request(child,
        prompt, parent, i)` and to the engine core.
    """
    params = request.sampling_params
    if params.n == 1:
        return None, [request]
    parent = ParentRequest(request.request_id, params.n, params.output_kind)
    children: list[EngineCoreRequest] = []
    for i in range(params.n):
        child_params = params.clone()
        child_params.n = 1
        if params.seed is not None:
            child_params.seed = params.seed + i
        children.append(dataclasses.replace(request, request_id=child_request_id(i, request.request_id),
                                            sampling_params=child_params))
    return parent, children
