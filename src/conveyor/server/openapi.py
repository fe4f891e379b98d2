"""GET /openapi.json, as vLLM serves it: the routes with their request bodies' JSON schemas.

The generation routes read their bodies themselves (server/request_body.py: a size cap, 415 for
non-JSON, 400s that name the field), so FastAPI cannot see the models behind them; this adds each POST
route's pydantic model as its `requestBody` (the models' `$defs` become `components/schemas`). The
schema is what a client generator or a fuzzer (tests/server/test_server_fuzz.py) reads; it is built
once, on the first request.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from conveyor.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest

REQUEST_MODELS: dict[str, type[BaseModel]] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
}
"""POST route -> the model its body is validated against (/invocations takes either generation body)."""
REF = "#/components/schemas/{model}"


def _body(schema: dict[str, Any]) -> dict[str, Any]:
    return {"required": True, "content": {"application/json": {"schema": schema}}}


def openapi_schema(app: FastAPI) -> dict[str, Any]:
    """The app's OpenAPI document with every POST body described."""
    document = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components: dict[str, Any] = document.setdefault("components", {}).setdefault("schemas", {})
    refs = {}
    for path, model in REQUEST_MODELS.items():
        schema = model.model_json_schema(ref_template=REF)
        components.update(schema.pop("$defs", {}))
        components[model.__name__] = schema
        refs[path] = {"$ref": REF.format(model=model.__name__)}
    refs["/invocations"] = {"oneOf": [refs["/v1/chat/completions"], refs["/v1/completions"]]}
    for path, ref in refs.items():
        operation = document["paths"].get(path, {}).get("post")
        if operation is not None:
            operation["requestBody"] = _body(ref)
    return document


def add_openapi_route(app: FastAPI) -> None:
    cache: dict[str, Any] = {}

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi() -> dict[str, Any]:
        if not cache:
            cache.update(openapi_schema(app))
        return cache
