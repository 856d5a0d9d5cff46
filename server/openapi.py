"""/openapi.json (OpenAPI 3.1) from the msgspec wire types, and the Swagger UI page at /docs.

FastAPI's own generator is off: it only knows pydantic models and the routes here decode
their bodies with msgspec. Instead every route is registered together with a `RouteDoc`
(see `server.app`), and the document is built from those: each request body schema is
`msgspec.json.schema_components` of the type the route decodes, so the document cannot drift
from what decodes, narrowed field by field (`server.schema`) to what the checks after
decoding accept, with the served engine's bounds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import msgspec
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse

from server.schema import Bounds, refine
from specloop.protocol import ErrorResponse

REF_TEMPLATE = "#/components/schemas/{name}"
SECURITY_SCHEME = "bearer"


@dataclasses.dataclass(frozen=True)
class RouteDoc:
    method: str  # GET | POST
    path: str
    summary: str
    body: type | None = None  # the msgspec type the route decodes its JSON body into
    response: type | None = None  # the msgspec type of its JSON answer
    stream: type | None = None  # with "stream": true, server-sent events of this type
    media_type: str | None = None  # of a non-JSON answer (text/plain, text/html); None: no body
    protected: bool = False  # needs the API key when the server has one


def openapi_document(routes: Sequence[RouteDoc], *, title: str, version: str, api_key: bool,
                     bounds: Bounds) -> dict[str, Any]:
    types = list(dict.fromkeys(t for r in routes for t in (r.body, r.response, r.stream) if t is not None))
    types.append(ErrorResponse)
    schemas, components = msgspec.json.schema_components(types, ref_template=REF_TEMPLATE)
    refine(components, bounds)
    schema_of = dict(zip(types, schemas))
    paths: dict[str, dict[str, Any]] = {}
    for route in routes:
        paths.setdefault(route.path, {})[route.method.lower()] = _operation(route, schema_of, api_key)
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version,
                 "description": "OpenAI-compatible completions and chat over a looped language model."},
        "paths": paths,
        "components": {"schemas": components},
    }
    if api_key:
        doc["components"]["securitySchemes"] = {SECURITY_SCHEME: {"type": "http", "scheme": "bearer"}}
    return doc


def request_schema(kind: type, bounds: Bounds) -> tuple[dict[str, Any], dict[str, Any]]:
    """The schema of one body type and the components it refers to, as the document holds them."""
    (schema,), components = msgspec.json.schema_components([kind], ref_template=REF_TEMPLATE)
    refine(components, bounds)
    return schema, components


def swagger_page(title: str) -> HTMLResponse:
    return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{title} API")


def _operation(route: RouteDoc, schema_of: dict[type, Any], api_key: bool) -> dict[str, Any]:
    op: dict[str, Any] = {
        "summary": route.summary,
        "operationId": f"{route.method.lower()}{route.path.replace('/', '_').replace('.', '_')}",
        "responses": {"200": _success(route, schema_of),
                      "default": {"description": "an error, in the OpenAI envelope",
                                  "content": {"application/json": {"schema": schema_of[ErrorResponse]}}}},
    }
    if route.body is not None:
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": schema_of[route.body]}}}
    if route.protected and api_key:
        op["security"] = [{SECURITY_SCHEME: []}]
    return op


def _success(route: RouteDoc, schema_of: dict[type, Any]) -> dict[str, Any]:
    content: dict[str, Any] = {}
    if route.response is not None:
        content["application/json"] = {"schema": schema_of[route.response]}
    description = "success"
    if route.stream is not None:
        content["text/event-stream"] = {"schema": schema_of[route.stream]}
        description = "success; with `stream: true`, `data: <chunk>` events, then `data: [DONE]`"
    if route.media_type is not None:  # JSON here is this document itself; otherwise text or HTML
        content[route.media_type] = {"schema": {"type": "object" if route.media_type == "application/json"
                                                else "string"}}
    answer: dict[str, Any] = {"description": description}
    if content:
        answer["content"] = content
    return answer
