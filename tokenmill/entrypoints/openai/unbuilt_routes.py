"""vLLM routes tokenmill does not serve yet: 501 with an OpenAI-style error body instead of a bare 404.

A client written for vLLM then reads why (e.g. "embeddings are not supported
yet"), and a load balancer does not mistake the server for a wrong URL.
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from tokenmill.entrypoints.openai.errors import error_response

# path -> what is missing (the start of the 501 message)
UNBUILT_ROUTES = {
    "/v1/embeddings": "Embeddings are",
    "/v1/score": "Scoring is",
    "/score": "Scoring is",
    "/v1/rerank": "Reranking is",
    "/rerank": "Reranking is",
    "/v2/rerank": "Reranking is",
    "/pooling": "Pooling is",
    "/classify": "Classification is",
    "/v1/audio/transcriptions": "Audio transcription is",
    "/v1/audio/translations": "Audio translation is",
}


def build_unbuilt_router() -> APIRouter:
    """POST on each of UNBUILT_ROUTES answers 501 (type "not_implemented_error")."""
    router = APIRouter()
    for path, what in UNBUILT_ROUTES.items():
        router.add_api_route(path, _answer_501(f"{what} not supported by tokenmill yet ({path}); it serves text "
                                               "generation only (/v1/completions, /v1/chat/completions)."),
                             methods=["POST"], include_in_schema=False)
    return router


def _answer_501(message: str):
    async def not_built() -> JSONResponse:
        return error_response(message, 501, err_type="not_implemented_error")

    return not_built
