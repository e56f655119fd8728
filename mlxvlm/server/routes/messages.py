"""``POST /v1/messages``: Anthropic's Messages API, answered by the same machinery as
chat completions (``answering.answer``) with Anthropic's body and events."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from mlxvlm.sampling_defaults import checkpoint_defaults
from mlxvlm.server.answering import answer
from mlxvlm.server.chat import sampling_options
from mlxvlm.server.deps import get_service, get_vocab_size, json_body
from mlxvlm.server.messages import MessageWriter, to_chat_request, warn_unknown_fields
from mlxvlm.server.messages_schemas import MessagesRequest
from mlxvlm.server.routes.models import unknown_model
from mlxvlm.server.service import GenerationService
from mlxvlm.server.tools import AnswerPlan

router = APIRouter()


async def messages_request(request: Request) -> MessagesRequest:
    return await json_body(request, MessagesRequest)


@router.post("/v1/messages")
async def messages(
    request: Request,
    body: MessagesRequest = Depends(messages_request),
    service: GenerationService = Depends(get_service),
    vocab_size: int = Depends(get_vocab_size),
) -> Response:
    config = service.config
    if body.model != config.model_id:
        raise unknown_model(config, body.model)
    warn_unknown_fields(body)
    chat = to_chat_request(body)
    options = sampling_options(chat, config.max_tokens, vocab_size,
                               checkpoint_defaults(service.processor))
    plan = AnswerPlan(chat, service.processor)
    writer = MessageWriter(config.model_id, plan)
    return await answer(request, chat, options, service, body=writer.body,
                        events=writer.events, plan=plan)
