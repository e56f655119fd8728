"""``/health``, ``/metrics`` and the model list: what a client or a monitor asks about
the server rather than of the model."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import PlainTextResponse

from mlxvlm.server import metrics
from mlxvlm.server.config import ServerConfig
from mlxvlm.server.answering import unknown_model
from mlxvlm.server.deps import get_config, get_service
from mlxvlm.server.service import GenerationService

router = APIRouter()


def model_card(service: GenerationService = Depends(get_service)) -> dict:
    return {
        "id": service.config.model_id,
        "object": "model",
        "created": int(service.started_at),
        "owned_by": "mlxvlm",
    }



@router.get("/health")
async def health() -> dict:
    return {"status": "ok"}


@router.get("/v1/models")
async def list_models(card: dict = Depends(model_card)) -> dict:
    return {"object": "list", "data": [card]}


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, card: dict = Depends(model_card),
                    config: ServerConfig = Depends(get_config)) -> dict:
    if model_id != config.model_id:
        raise unknown_model(config, model_id)
    return card


@router.get("/metrics")
async def get_metrics(service: GenerationService = Depends(get_service)) -> PlainTextResponse:
    return PlainTextResponse(metrics.render_metrics(service), media_type=metrics.CONTENT_TYPE)
