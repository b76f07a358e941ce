"""The HTTP face of the engine: OpenAI's /v1/completions, /v1/chat/completions and /v1/models, and llama.cpp's
/health, /props, /slots and /metrics. Every error is an OpenAI error body ({"error": {"message", "type",
"param", "code"}}): 400 for a body that is not JSON, an unknown or out-of-range parameter (the engine's own
checks: SamplingParams, check_max_tokens, the prompt's ids) or a prompt longer than the context; 401 without
the --api-key; 503 with Retry-After when every slot is busy and the queue is full."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
import uuid
from pathlib import Path
from typing import Any, Union

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from ..errors import CupyllmError, InputError, SamplingError
from ..generate import check_max_tokens
from ..sampling import SamplingParams
from .engine import Engine, QueueFull, Request, Result, SlotBusy, TokenLogprob
from .metrics import metrics_text

Number = Union[StrictInt, float]
DISCONNECT_POLL_SECONDS = 0.25  # a non-streamed request checks this often whether its client went away


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Body):
    include_usage: StrictBool = False


class _Sampling(_Body):
    model: str | None = None
    max_tokens: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None
    min_p: Number | None = None
    repeat_penalty: Number | None = None
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    n: StrictInt = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Number | None = None  # accepted at 0 (OpenAI's default) only
    frequency_penalty: Number | None = None
    user: str | None = None


class CompletionBody(_Sampling):
    prompt: str | list[str] | list[StrictInt]
    logprobs: StrictInt | None = None  # the legacy API: how many top tokens per position
    echo: StrictBool = False


class ChatBody(_Sampling):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class SlotFileBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    filename: StrictStr | None = None


def _slot_file_name(body: SlotFileBody | None) -> str:
    """The file name a slot action names: a plain name inside --slot-save-path, as llama-server allows."""
    name = body.filename if body is not None else None
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name or name.startswith("."):
        raise APIError(400, f"filename must be a plain file name inside the slot save folder, got {name!r}",
                       "filename")
    return name


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers


def _error(status: int, message: str, param=None, code=None, kind="invalid_request_error", headers=None):
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


MAX_TOP_LOGPROBS = 20  # OpenAI's limit


class _BearerAuth:
    """Every call but /health must carry `Authorization: Bearer KEY`. A plain ASGI middleware: starlette's
    @app.middleware("http") passes each streamed chunk through a memory stream and a task of its own, work on
    the event loop's thread for every token of every stream, beside the decode's threads on the same cores."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode("latin-1")

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health":
            if dict(scope["headers"]).get(b"authorization", b"") != self.expected:
                response = _error(401, "invalid or missing API key (Authorization: Bearer KEY)",
                                  code="invalid_api_key", kind="authentication_error")
                return await response(scope, receive, send)
        return await self.app(scope, receive, send)


def create_app(model, parallel: int = 1, *, api_key: str | None = None, queue_size: int = 16,
               time_limit: float | None = None, alias: str | None = None,
               slot_save_path: str | Path | None = None) -> FastAPI:
    """The app serving `model` with `parallel` slots (engine.Engine); api_key: a bearer token every /v1,
    /props, /slots and /metrics call must carry; queue_size: requests that may wait for a slot beyond the
    busy ones (more: 503); time_limit: seconds a request may run (then it ends with finish_reason "length");
    slot_save_path: the folder POST /slots/{id}?action=save|restore reads and writes (None: no slot actions)."""
    engine_box: dict[str, Engine] = {}
    model_name = alias or model.path.name
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine_box["engine"] = Engine(model, parallel=parallel, queue_size=queue_size, time_limit=time_limit)
        app.state.engine = engine_box["engine"]
        try:
            yield
        finally:  # (uvicorn's shutdown on SIGINT / SIGTERM: cancel what runs, stop the threads)
            await asyncio.to_thread(engine_box["engine"].close)

    app = FastAPI(title="cupyllm", lifespan=lifespan)

    def engine() -> Engine:
        if "engine" not in engine_box:  # (an app used without its lifespan: started on first use)
            engine_box["engine"] = app.state.engine = Engine(model, parallel=parallel, queue_size=queue_size,
                                                             time_limit=time_limit)
        return engine_box["engine"]

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return _error(exc.status, exc.message, exc.param, exc.code, exc.kind, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        if first.get("type") == "json_invalid":
            return _error(400, f"the request body is not valid JSON: {first.get('msg', '')}", code="invalid_json")
        if first.get("type") == "extra_forbidden":
            return _error(400, f"unknown parameter {'.'.join(loc)!r}", param=".".join(loc) or None,
                          code="unknown_parameter")
        return _error(400, f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid')}", param=".".join(loc) or None)

    if api_key is not None:
        app.add_middleware(_BearerAuth, api_key=api_key)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "cupyllm", "meta": _model_meta(model)}]}

    @app.get("/props")
    async def props():
        eng = engine()
        return {"model_path": str(model.path), "model_alias": model_name, "total_slots": len(eng.slots),
                "n_ctx": model.kv_spec.ctx, "device": model.device, "batched_decode": True,
                "queue_size": eng.queue_size, "time_limit": time_limit,
                "chat_template": model.gguf.metadata.get("tokenizer.chat_template"),
                "default_generation_settings": {**dataclasses.asdict(SamplingParams()), "n_predict": -1},
                "kv": _kv_props(model), "speculative": None if model.spec is None else dataclasses.asdict(model.spec)}

    @app.get("/slots")
    async def slots():
        eng = engine()
        return [_slot_props(model, slot) for slot in eng.slots]

    @app.post("/slots/{slot_id}")
    async def slot_action(slot_id: int, action: str, body: SlotFileBody | None = None):
        """llama-server's slot actions: save the idle slot's cache to a file of the --slot-save-path folder,
        restore it from one (a later prompt sharing its beginning prefills only the rest), or erase it."""
        if slot_save_path is None:
            raise APIError(501, "this server does not support slot actions: start it with --slot-save-path DIR",
                           kind="not_supported_error")
        if action not in ("save", "restore", "erase"):
            raise APIError(400, f"unknown slot action {action!r}: save, restore or erase", "action")
        eng, start = engine(), time.perf_counter()
        try:
            if action == "erase":
                n = await asyncio.to_thread(eng.erase_slot, slot_id)
                return {"id_slot": slot_id, "n_erased": n}
            path = Path(slot_save_path) / _slot_file_name(body)
            if action == "save":
                n = await asyncio.to_thread(eng.save_slot, slot_id, path)
                return {"id_slot": slot_id, "filename": path.name, "n_saved": n, "n_written": path.stat().st_size,
                        "timings": {"save_ms": 1e3 * (time.perf_counter() - start)}}
            n = await asyncio.to_thread(eng.restore_slot, slot_id, path)
            return {"id_slot": slot_id, "filename": path.name, "n_restored": n, "n_read": path.stat().st_size,
                    "timings": {"restore_ms": 1e3 * (time.perf_counter() - start)}}
        except SlotBusy as exc:
            raise APIError(409, str(exc), code="slot_busy") from None
        except InputError as exc:
            raise APIError(400, str(exc)) from None

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(metrics_text(engine(), model), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, http: HTTPRequest):
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError(400, "one prompt per request (a list of several prompts is not supported)", "prompt")
            prompt = prompt[0]
        if body.echo:
            raise APIError(400, "echo is not supported", "echo")
        if body.logprobs is not None and not 0 <= body.logprobs <= MAX_TOP_LOGPROBS:
            raise APIError(400, f"logprobs must be 0 .. {MAX_TOP_LOGPROBS}, got {body.logprobs}", "logprobs")
        ids = _ids(lambda: model._prompt_ids(prompt, False, None))
        request = _request(model, body, ids, body.max_tokens if body.max_tokens is not None else 16, body.logprobs)
        return await _respond(engine(), http, request, body, kind="text_completion", model_name=model_name)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody, http: HTTPRequest):
        messages = [_message(m, i) for i, m in enumerate(body.messages)]
        ids = _ids(lambda: model.chat_ids(messages, body.chat_template_kwargs))
        top = None
        if body.logprobs:
            top = body.top_logprobs or 0
            if not 0 <= top <= MAX_TOP_LOGPROBS:
                raise APIError(400, f"top_logprobs must be 0 .. {MAX_TOP_LOGPROBS}, got {top}", "top_logprobs")
        elif body.top_logprobs is not None:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        request = _request(model, body, ids, -1 if limit is None else limit, top)
        return await _respond(engine(), http, request, body, kind="chat.completion", model_name=model_name)

    return app


def _model_meta(model) -> dict:
    cfg = model.cfg
    return {"arch": cfg.arch, "n_vocab": cfg.n_vocab, "n_ctx_train": cfg.ctx_train, "n_ctx": model.kv_spec.ctx,
            "n_layer": cfg.n_layer, "size": model.path.stat().st_size}


def _kv_props(model) -> dict:
    spec = model.kv_spec
    out = {"n_ctx": spec.ctx, "type_k": spec.kv_type_k, "type_v": spec.kv_type_v, "max_chunk": spec.max_chunk,
           "normalize_k": spec.k_normalized, "float_mirror": bool(spec.float_mirror),
           "spill": None, "dca": None, "plan": None}
    if spec.spilled:
        out["spill"] = {"device_window": spec.device_window,
                        "host_positions": spec.ctx - spec.device_window}
    if model.spill_plan is not None:
        out["spill_plan"] = {k: v for k, v in dataclasses.asdict(model.spill_plan).items()
                             if isinstance(v, (int, float, str, bool, type(None)))}
    if model.dca is not None:
        out["dca"] = dataclasses.asdict(model.dca)
    if model.kv_plan is not None:
        out["plan"] = {"tier": model.kv_plan.tier.kv_type_k + "/" + model.kv_plan.tier.kv_type_v}
    return out


def _slot_props(model, slot) -> dict:
    cache = slot.cache
    spilled = [layer for layer in cache.own_layers() if getattr(layer, "spilled", False)]
    host_bytes = sum(int(getattr(layer, "host_bytes", 0)) for layer in spilled)
    return {"id": slot.id, "state": slot.state, "is_processing": slot.request is not None,
            "n_ctx": cache.spec.ctx, "tokens_cached": int(cache.n_past),
            "n_prompt_tokens": slot.n_prompt, "n_decoded": slot.n_decoded,
            "kv_type_k": cache.spec.kv_type_k, "kv_type_v": cache.spec.kv_type_v, "kv_bytes": int(cache.nbytes),
            "spill": {"device_window": cache.spec.device_window, "host_bytes": host_bytes} if cache.spec.spilled
            else None,
            "dca": dataclasses.asdict(model.dca) if model.dca is not None else None}


def _message(message: dict, index: int) -> dict:
    role, content = message.get("role"), message.get("content")
    if role not in ("system", "developer", "user", "assistant", "tool"):
        raise APIError(400, f"messages[{index}].role must be system, user, assistant or tool; got {role!r}",
                       f"messages.{index}.role")
    if isinstance(content, list):  # content parts: the text ones
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(400, f"messages[{index}].content: only text parts are supported",
                               f"messages.{index}.content")
            parts.append(part["text"])
        content = "".join(parts)
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise APIError(400, f"messages[{index}].content must be text", f"messages.{index}.content")
    return {**message, "role": "system" if role == "developer" else role, "content": content}


def _ids(make) -> list[int]:
    try:
        return make()
    except (InputError, CupyllmError) as exc:
        raise APIError(400, str(exc), "prompt") from None
    except Exception as exc:  # a chat template that fails on these messages (jinja2 raises its own errors)
        raise APIError(400, f"the prompt could not be rendered: {type(exc).__name__}: {exc}", "messages") from None


def _request(model, body: _Sampling, ids: list[int], max_tokens: int, logprobs: int | None) -> Request:
    if body.n != 1:
        raise APIError(400, f"n must be 1 (one choice per request), got {body.n}", "n")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name) not in (None, 0):
            raise APIError(400, f"{name} is not supported (use repeat_penalty)", name)
    try:
        max_tokens = check_max_tokens(max_tokens)
    except InputError as exc:
        raise APIError(400, str(exc), "max_tokens") from None
    given = {name: getattr(body, name) for name in ("temperature", "top_p", "top_k", "min_p", "repeat_penalty",
                                                    "seed") if getattr(body, name) is not None}
    try:
        params = SamplingParams(**given)
    except SamplingError as exc:
        raise APIError(400, str(exc), next(iter(given), None)) from None
    need = len(ids) + (1 if max_tokens != 0 else 0)
    if need > model.kv_spec.ctx:
        raise APIError(400, f"the prompt's {len(ids)} tokens exceed the context of {model.kv_spec.ctx} tokens "
                            "(the server's -c/--ctx)", "messages" if isinstance(body, ChatBody) else "prompt",
                       code="context_length_exceeded")
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    return Request(ids=ids, params=params, max_tokens=max_tokens, stop=stops, emit=lambda *_: None,
                   logprobs=logprobs)


async def _respond(engine: Engine, http: HTTPRequest, request: Request, body: _Sampling, *, kind: str,
                   model_name: str):
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    request.emit = lambda event, payload: loop.call_soon_threadsafe(events.put_nowait, (event, payload))
    try:
        engine.submit(request)
    except QueueFull as exc:
        raise APIError(503, f"the server is busy: {exc}; retry later", code="server_busy", kind="server_error",
                       headers={"Retry-After": "1"}) from None
    chat = kind == "chat.completion"
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    created = int(time.time())
    tokenizer = engine.model.tokenizer
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return StreamingResponse(_stream(events, request, rid, created, model_name, chat, include_usage, tokenizer),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    pieces, records = [], []
    try:
        while True:
            try:
                event, payload = await asyncio.wait_for(events.get(), DISCONNECT_POLL_SECONDS)
            except asyncio.TimeoutError:
                if await http.is_disconnected():
                    request.cancel()
                continue
            if event == "text":
                pieces.append(payload[0])
                records.extend(payload[1])
            else:
                result: Result = payload
                break
    except BaseException:  # (the handler itself cancelled: the client went away)
        request.cancel()
        raise
    _raise_failed(result)
    text = "".join(pieces)
    logprobs = None if request.logprobs is None else (_chat_logprobs(records, tokenizer) if chat
                                                      else _completion_logprobs(records, tokenizer))
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                  "finish_reason": result.finish_reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": result.finish_reason}
    return {"id": rid, "object": kind, "created": created, "model": model_name, "choices": [choice],
            "usage": _usage(result)}


def _raise_failed(result: Result) -> None:
    if result.error is not None:
        raise APIError(500, f"generation failed: {result.error}", kind="server_error")


def _usage(result: Result) -> dict:
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
            "total_tokens": result.prompt_tokens + result.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": result.cached_tokens}}


async def _stream(events: asyncio.Queue, request: Request, rid: str, created: int, model_name: str, chat: bool,
                  include_usage: bool, tokenizer):
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(text: str | None, finish: str | None, records=(), role: bool = False) -> str:
        logprobs = None
        if request.logprobs is not None and records:
            logprobs = _chat_logprobs(records, tokenizer) if chat else _completion_logprobs(records, tokenizer)
        if chat:
            delta = {} if text is None else {"content": text}
            if role:
                delta = {"role": "assistant", "content": ""}
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        body = {"id": rid, "object": obj, "created": created, "model": model_name, "choices": [choice]}
        if include_usage:
            body["usage"] = None
        return f"data: {json.dumps(body)}\n\n"

    try:
        if chat:
            yield chunk(None, None, role=True)
        while True:
            event, payload = await events.get()
            if event == "text":
                yield chunk(payload[0], None, payload[1])
                continue
            result: Result = payload
            if result.error is not None:
                error = {"error": {"message": f"generation failed: {result.error}", "type": "server_error",
                                   "param": None, "code": None}}
                yield f"data: {json.dumps(error)}\n\n"
            else:
                yield chunk(None if chat else "", result.finish_reason)
                if include_usage:
                    yield f"data: {json.dumps({'id': rid, 'object': obj, 'created': created, 'model': model_name, 'choices': [], 'usage': _usage(result)})}\n\n"
            yield "data: [DONE]\n\n"
            return
    finally:  # the client went away mid-stream (or the stream ended): the slot stops at its next step
        request.cancel()


def _token_entry(tokenizer, token: int, logprob: float) -> dict:
    data = tokenizer.token_bytes(token, True)
    return {"token": data.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(data)}


def _chat_logprobs(records: list[TokenLogprob], tokenizer) -> dict:
    return {"content": [{**_token_entry(tokenizer, r.token, r.logprob),
                         "top_logprobs": [_token_entry(tokenizer, t, lp) for t, lp in r.top]} for r in records]}


def _completion_logprobs(records: list[TokenLogprob], tokenizer) -> dict:
    tokens = [_token_entry(tokenizer, r.token, r.logprob)["token"] for r in records]
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {"tokens": tokens, "token_logprobs": [r.logprob for r in records],
            "top_logprobs": [_top_by_text(tokenizer, r.top) for r in records],
            "text_offset": offsets}


def _top_by_text(tokenizer, top: list[tuple[int, float]]) -> dict:
    """The legacy API's {token text: logprob}; tokens of the same text (bytes of a split character all read
    U+FFFD) keep the likeliest's."""
    out = {}
    for token, logprob in top:
        out.setdefault(_token_entry(tokenizer, token, logprob)["token"], logprob)
    return out
