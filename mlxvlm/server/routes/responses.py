"""``POST /v1/responses``: OpenAI's Responses API, answered by the same machinery as
chat completions (``answering.answer``), continuing stored conversations by
``previous_response_id``."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from mlxvlm.server.answering import answer, plan_answer
from mlxvlm.server.deps import body_dependencies
from mlxvlm.server.errors import APIError
from mlxvlm.server.response_store import ResponseStore
from mlxvlm.server.responses import ResponseWriter, input_messages, to_chat_request
from mlxvlm.server.responses_schemas import ResponsesRequest
from mlxvlm.server.security import KEY_ID
from mlxvlm.server.service import GenerationService

router = APIRouter()


def get_store(request: Request) -> ResponseStore:
    return request.app.state.response_store


responses_request, responses_service = body_dependencies(ResponsesRequest)
Body = Annotated[ResponsesRequest, Depends(responses_request)]
Service = Annotated[GenerationService, Depends(responses_service)]
Store = Annotated[ResponseStore, Depends(get_store)]


@router.post("/v1/responses")
async def responses(request: Request, body: Body, service: Service, store: Store) -> Response:
    namespace = request.scope.get("state", {}).get(KEY_ID)
    earlier: list = []
    if body.previous_response_id is not None:
        earlier = store.get(namespace, body.previous_response_id)
        if earlier is None:
            raise APIError(400, f"previous response {body.previous_response_id!r} not found "
                           "(it was not stored, or this server no longer keeps it: "
                           "--max-stored-responses and --max-stored-response-bytes)",
                           param="previous_response_id", code="previous_response_not_found")
    chat = to_chat_request(body, earlier)
    options, plan = plan_answer(chat, service)
    writer = ResponseWriter(service.config.model_id, body, earlier + input_messages(body), store,
                            namespace, plan)
    return await answer(request, chat, options, service, body=writer.body,
                        events=writer.events, plan=plan, param="input",
                        format_param="text.format")
