"""``/health``, ``/metrics`` and the model list: what a client or a monitor asks about
the server rather than of a model."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import PlainTextResponse

from mlxvlm.server import metrics
from mlxvlm.server.deps import get_models
from mlxvlm.server.models_registry import ModelRegistry

router = APIRouter()


def model_card(models: ModelRegistry, model_id: str) -> dict:
    """OpenAI's model object, with what the model does: ``capabilities``, some of
    "chat", "embed" and "rerank" (null where it is not known before the model loads)."""
    return {
        "id": model_id,
        "object": "model",
        "created": int(models.started_at),
        "owned_by": "mlxvlm",
        "capabilities": models.capabilities(model_id),
    }


@router.get("/health")
async def health() -> dict:
    return {"status": "ok"}


@router.get("/v1/models")
async def list_models(models: ModelRegistry = Depends(get_models)) -> dict:
    """Every model served, loaded or not (a request naming one loads it)."""
    return {"object": "list", "data": [model_card(models, m) for m in models.ids()]}


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, models: ModelRegistry = Depends(get_models)) -> dict:
    if model_id not in models.sources:
        raise models.unknown_model(model_id)
    return model_card(models, model_id)


@router.get("/metrics")
async def get_metrics(request: Request,
                      models: ModelRegistry = Depends(get_models)) -> PlainTextResponse:
    return PlainTextResponse(metrics.render_metrics(models, request.app.state),
                             media_type=metrics.CONTENT_TYPE)
