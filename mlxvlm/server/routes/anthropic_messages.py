"""``POST /v1/messages``: Anthropic's Messages API, answered by the same machinery as
chat completions (``answering.answer``) with Anthropic's body and events."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from mlxvlm.server.answering import answer, plan_answer
from mlxvlm.server.deps import body_dependencies
from mlxvlm.server.anthropic_messages import MessageWriter, to_chat_request
from mlxvlm.server.anthropic_schemas import MessagesRequest
from mlxvlm.server.service import GenerationService

router = APIRouter()


messages_request, messages_service = body_dependencies(MessagesRequest)
Body = Annotated[MessagesRequest, Depends(messages_request)]
Service = Annotated[GenerationService, Depends(messages_service)]


@router.post("/v1/messages")
async def messages(request: Request, body: Body, service: Service) -> Response:
    chat = to_chat_request(body)
    options, plan = plan_answer(chat, service)
    writer = MessageWriter(service.config.model_id, plan)
    return await answer(request, chat, options, service, body=writer.body,
                        events=writer.events, plan=plan)
