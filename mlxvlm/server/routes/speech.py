"""``POST /v1/audio/speech``: the model says the input (``server.speech.say``), answered
with the audio's bytes (raw PCM streamed as it is decoded)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from mlxvlm.server.deps import body_dependencies
from mlxvlm.server.service import GenerationService
from mlxvlm.server.speech import say
from mlxvlm.server.speech_schemas import SpeechBody

router = APIRouter()

speech_request, speech_service = body_dependencies(SpeechBody)
Body = Annotated[SpeechBody, Depends(speech_request)]
Service = Annotated[GenerationService, Depends(speech_service)]


@router.post("/v1/audio/speech")
async def audio_speech(request: Request, body: Body, service: Service) -> Response:
    return await say(request, body, service)
