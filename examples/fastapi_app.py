"""aiokv inside a FastAPI service: the engine starts in the app's lifespan, on the
server's own event loop, and each request serves one step of a user's history through
it (asyncio_serving.py's Recommender). aiokv errors become HTTP statuses.

    pip install 'aiokv[web]'
    python examples/fastapi_app.py                # serves on 127.0.0.1:8000
    curl -X POST '127.0.0.1:8000/users/7/step?new_tokens=40'
    python examples/fastapi_app.py --self-test    # starts it on a free port, drives it, exits

Endpoints: ``POST /users/{user}/step?new_tokens=N``, ``GET /users/{user}/cached?num_tokens=N``,
``GET /stats``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import httpx
import uvicorn
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
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

import aiokv


def create_app(config: Mapping[str, Any] | str | None = CONFIG) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        caches = make_caches()
        # `async with` starts the engine's batcher as a task of this loop and drains it
        # when the server shuts down, after the last request.
        async with aiokv.open_engine(config, kv_caches=caches) as engine:
            app.state.recommender = Recommender(engine, caches)
            yield

    app = FastAPI(title="aiokv example", lifespan=lifespan)

    @app.exception_handler(aiokv.AiokvError)
    async def aiokv_error(request: Request, exc: aiokv.AiokvError) -> JSONResponse:
        headers = {"Retry-After": "1"} if isinstance(exc, aiokv.Overloaded) else None
        return JSONResponse(error_body(exc), status_code=http_status(exc), headers=headers)

    def recommender(request: Request) -> Recommender:
        found: Recommender = request.app.state.recommender
        return found

    @app.post("/users/{user}/step")
    async def step(user: int, new_tokens: int, request: Request) -> dict[str, Any]:
        return dataclasses.asdict(await recommender(request).step(user, new_tokens))

    @app.get("/users/{user}/cached")
    async def cached(user: int, num_tokens: int, request: Request) -> dict[str, int]:
        return {"cached_tokens": await recommender(request).cached(user, num_tokens)}

    @app.get("/stats")
    async def stats(request: Request) -> dict[str, Any]:
        return dataclasses.asdict(recommender(request).engine.stats())

    return app


async def self_test() -> int:
    sock = free_socket()
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(), log_level="warning"))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if serving.done():  # it failed to start: say why
            await serving
            return 1
        await asyncio.sleep(0.01)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:

        async def call(method: str, path: str) -> tuple[int, Any]:
            response = await client.request(method, path)
            return response.status_code, response.json()

        problems = await exercise(call)
    server.should_exit = True
    await serving
    return report("fastapi", port, problems)


def serve(port: int) -> None:
    uvicorn.run(create_app(), host="127.0.0.1", port=port)


if __name__ == "__main__":
    sys.exit(web_main(__doc__, self_test, serve, port=8000))
