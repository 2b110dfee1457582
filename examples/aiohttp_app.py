"""aiokv inside an aiohttp service: the engine lives in the app's ``cleanup_ctx`` (started
on the server's loop before the first request, drained at shutdown), and each request
serves one step of a user's history through it (asyncio_serving.py's Recommender). A
middleware turns aiokv errors into HTTP statuses.

    pip install 'aiokv[web]'
    python examples/aiohttp_app.py                # serves on 127.0.0.1:8080
    python examples/aiohttp_app.py --self-test    # starts it on a free port, drives it, exits

Endpoints: as in fastapi_app.py.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from aiohttp import ClientSession, web
from asyncio_serving import (
    CONFIG,
    Recommender,
    error_body,
    exercise,
    free_socket,
    http_status,
    make_caches,
    report,
    web_main,
)

import aiokv

RECOMMENDER = web.AppKey("recommender", Recommender)


async def engine_context(app: web.Application) -> AsyncIterator[None]:
    caches = make_caches()
    async with aiokv.open_engine(CONFIG, kv_caches=caches) as engine:
        app[RECOMMENDER] = Recommender(engine, caches)
        yield


@web.middleware
async def aiokv_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    try:
        return await handler(request)
    except aiokv.AiokvError as exc:
        headers = {"Retry-After": "1"} if isinstance(exc, aiokv.Overloaded) else None
        return web.json_response(error_body(exc), status=http_status(exc), headers=headers)


def int_query(request: web.Request, name: str) -> int:
    try:
        return int(request.query[name])
    except (KeyError, ValueError):
        # The middleware answers it as aiokv's own: 422 with a JSON body naming the field.
        raw = request.query.get(name)
        raise aiokv.InvalidRequest(name, f"an integer is required, got {raw!r}") from None


async def step(request: web.Request) -> web.Response:
    user = int(request.match_info["user"])
    result = await request.app[RECOMMENDER].step(user, int_query(request, "new_tokens"))
    return web.json_response(dataclasses.asdict(result))


async def cached(request: web.Request) -> web.Response:
    user = int(request.match_info["user"])
    tokens = await request.app[RECOMMENDER].cached(user, int_query(request, "num_tokens"))
    return web.json_response({"cached_tokens": tokens})


async def stats(request: web.Request) -> web.Response:
    return web.json_response(dataclasses.asdict(request.app[RECOMMENDER].engine.stats()))


def create_app() -> web.Application:
    app = web.Application(middlewares=[aiokv_errors])
    app.cleanup_ctx.append(engine_context)
    app.router.add_post(r"/users/{user:\d+}/step", step)
    app.router.add_get(r"/users/{user:\d+}/cached", cached)
    app.router.add_get("/stats", stats)
    return app


async def self_test() -> int:
    sock = free_socket()
    port = sock.getsockname()[1]
    runner = web.AppRunner(create_app())
    await runner.setup()  # runs engine_context up to its yield: the engine is started
    await web.SockSite(runner, sock).start()
    try:
        async with ClientSession(f"http://127.0.0.1:{port}") as client:

            async def call(method: str, path: str) -> tuple[int, Any]:
                async with client.request(method, path) as response:
                    return response.status, await response.json()

            problems = await exercise(call)
    finally:
        await runner.cleanup()  # and the rest of engine_context: the engine drains
    return report("aiohttp", port, problems)


def serve(port: int) -> None:
    web.run_app(create_app(), host="127.0.0.1", port=port)


if __name__ == "__main__":
    sys.exit(web_main(__doc__, self_test, serve, port=8080))
