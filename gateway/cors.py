"""CORS for browser clients (the openai JS SDK in a page, web UIs), as vLLM's server has it on by default.

`--allowed-origins` ("*" by default, as vLLM's; a comma list of origins; "" turns CORS off): a preflight (OPTIONS
with Origin and Access-Control-Request-Method) is answered 200 before any other check (the API key's included:
browsers send no credentials on a preflight), naming the methods and echoing the headers asked for; every other
response to a request from an allowed origin carries Access-Control-Allow-Origin, streams too (set as the headers
are prepared). No credentials mode: the API key travels in the Authorization header, not in cookies.
"""

from __future__ import annotations

from aiohttp import web

METHODS = "GET, POST, OPTIONS"
MAX_AGE_S = "600"


def parse_origins(text: str) -> frozenset[str]:
    return frozenset(o.strip() for o in text.split(",") if o.strip())


def _allowed(origins: frozenset[str], origin: str | None) -> str | None:
    """The Access-Control-Allow-Origin value for a request from `origin`, None when it gets none."""
    if not origin or not origins:
        return None
    return "*" if "*" in origins else origin if origin in origins else None


def install(app: web.Application, origins: frozenset[str]):
    """The preflight middleware (to go first) and the response signal; None (and nothing installed) when off."""
    if not origins:
        return None

    @web.middleware
    async def preflight(request: web.Request, handler):
        if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
            allow = _allowed(origins, request.headers.get("Origin"))
            if allow is None:
                return web.Response(status=403, text="origin not allowed")
            return web.Response(status=200, headers={
                "Access-Control-Allow-Origin": allow, "Access-Control-Allow-Methods": METHODS,
                "Access-Control-Allow-Headers": request.headers.get("Access-Control-Request-Headers", "*"),
                "Access-Control-Max-Age": MAX_AGE_S, "Vary": "Origin"})
        return await handler(request)

    async def on_prepare(request: web.Request, response: web.StreamResponse) -> None:
        allow = _allowed(origins, request.headers.get("Origin"))
        if allow is not None:
            response.headers["Access-Control-Allow-Origin"] = allow
            if allow != "*":
                response.headers["Vary"] = "Origin"

    app.on_response_prepare.append(on_prepare)
    return preflight
