"""`cupyllm serve` (cupyllm/server/) through the official OpenAI client against uvicorn on a loopback port, on
the tiny models: the texts are those Model.generate gives one request at a time; streamed deltas add up to the
whole text; usage counts; every error body; concurrent requests batched into one forward; a client that goes
away frees its slot; the metrics move. And models/batch.py's forward against Transformer.forward per sequence."""
from __future__ import annotations

import contextlib
import json
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

import cupyllm  # noqa: E402
from cupyllm.models.batch import Segment, forward_batch  # noqa: E402
from cupyllm.server import create_app  # noqa: E402
from models import gemma_path  # noqa: E402

GREEDY = dict(temperature=0)
PROMPTS = ["the cat sat on", "hello world, this is", "a b c d e f", "one two"]


@contextlib.contextmanager
def serving(model, **options):
    """The app on a free loopback port, in a thread; yields its base URL."""
    app = create_app(model, **options)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


LONG_REQUEST = {"prompt": "zz", "max_tokens": 60, "stream": True, "temperature": 0}


_RUNS_LONG: set[int] = set()  # models checked to run LONG_REQUEST to max_tokens


@contextlib.contextmanager
def slowed(model, seconds=0.02):
    """Each forward of one sequence takes `seconds` longer, so that a LONG_REQUEST (which, greedy, runs its
    60 tokens: checked) keeps its slot for over a second."""
    if id(model) not in _RUNS_LONG:
        model.generate(LONG_REQUEST["prompt"], max_tokens=LONG_REQUEST["max_tokens"], temperature=0)
        assert model.last_stats.stop_reason == "max_tokens"
        _RUNS_LONG.add(id(model))
    run = model._forward_numpy_graphed

    def slow(*args, **kwargs):
        time.sleep(seconds)
        return run(*args, **kwargs)

    model._forward_numpy_graphed = slow
    try:
        yield
    finally:
        del model._forward_numpy_graphed


def client(url, api_key="none"):
    return openai.OpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0, timeout=60)


def metric(url, name) -> float:
    text = httpx.get(url + "/metrics").text
    match = re.search(rf"^cupyllm:{name} (\S+)$", text, re.M)
    assert match, f"cupyllm:{name} missing from /metrics"
    return float(match.group(1))


@pytest.fixture(scope="module")
def qwen(tiny_model):
    path, _, _ = tiny_model("qwen2")
    return cupyllm.load(path, device="cpu", ctx=96, progress=False)


@pytest.fixture(scope="module")
def gemma4(tiny_model):  # the tiny model with a chat template; sliding windows and KV-shared layers
    path, _, _ = tiny_model("gemma4")
    return cupyllm.load(path, device="cpu", ctx=96, progress=False)


@pytest.mark.parametrize("arch, options", [("qwen2", {}), ("qwen3-moe", {}), ("gemma3", {}), ("gemma4", {}),
                                           ("qwen35", {}), ("qwen35-moe", {}), ("qwen3next", {}),
                                           ("gemma4-moe", {}),
                                           ("qwen2", {"dca": {"chunk_size": 16, "local_size": 4},
                                                      "kv_type_k": "q8_0", "kv_type_v": "q4_0"})])
def test_batched_forward_equals_one_sequence_at_a_time(tiny_model, arch, options):
    """Prefill 3 prompts one by one, then 3 decode steps: the batched forward's logits are Transformer.forward's
    on each sequence alone, bit for bit (attention over each sequence's own cache, its sliding window, Gemma 4's
    shared caches; the hybrids' DeltaNet layers on each sequence's own recurrent states; Dual Chunk Attention
    across chunk boundaries over quantized, K-normalised caches)."""
    path, _, _ = tiny_model(arch)
    model = cupyllm.load(path, device="cpu", ctx=64, progress=False, **options)
    t = model.transformer
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, model.cfg.n_vocab, size=n) for n in (5, 23, 2)]
    alone = [t.ops.new_cache(model.cfg, model.kv_spec) for _ in prompts]
    batched = [t.ops.new_cache(model.cfg, model.kv_spec) for _ in prompts]
    for ids, a, b in zip(prompts, alone, batched):
        want = t.forward(ids, np.arange(len(ids)), a)
        got, = forward_batch(t, [Segment(ids, b)])
        a.n_past = b.n_past = len(ids)
        np.testing.assert_array_equal(got, want)
    for step in range(3):
        tokens = [np.array([int(rng.integers(3, model.cfg.n_vocab))]) for _ in prompts]
        # the last step: one sequence verifies a drafted run (all its logits); not with the tiny MoEs, whose
        # float32 experts multiply the rows routed to them together, rounding unlike the sequence alone
        draft_run = step == 2 and model.cfg.n_expert == 0
        if draft_run:
            tokens[1] = rng.integers(3, model.cfg.n_vocab, size=3)
        got = forward_batch(t, [Segment(tk, b, all_logits=draft_run and i == 1)
                                for i, (tk, b) in enumerate(zip(tokens, batched))])
        for i, (tk, a, b) in enumerate(zip(tokens, alone, batched)):
            want = t.forward(tk, np.arange(a.n_past, a.n_past + len(tk)), a, all_logits=draft_run and i == 1)
            a.n_past += len(tk)
            b.n_past += len(tk)
            np.testing.assert_array_equal(got[i], want)


@pytest.mark.parametrize("arch, options", [("qwen2", {}), ("gemma3", {}), ("gemma4", {}), ("qwen35", {}),
                                           ("real-gemma", {}),
                                           ("qwen2", {"dca": {"chunk_size": 16, "local_size": 4},
                                                      "kv_type_k": "q8_0", "kv_type_v": "q4_0"})])
def test_prompts_prefill_together_as_alone(tiny_model, arch, options):
    """Prompts of at least rows_independent_from tokens in one forward (the server's waiting prompt chunks): each
    prompt's logits, and the next step's on its cache, are those of the prompt alone, bit for bit (the real
    Gemma 3 270M: Q8_0 / Q5_0 / Q4_K / Q6_K weights, interleaved, through the GEMM, rows independent). Not a mixture of
    experts: an expert multiplies the rows routed to it from every prompt together (the server prefills their
    prompts one by one)."""
    path = gemma_path() if arch == "real-gemma" else tiny_model(arch)[0]
    model = cupyllm.load(path, device="cpu", ctx=96, progress=False, **options)
    t = model.transformer
    shortest = t.ops.rows_independent_from
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, model.cfg.n_vocab, size=n) for n in (shortest, shortest + 11, shortest + 5)]
    alone = [t.ops.new_cache(model.cfg, model.kv_spec) for _ in prompts]
    together = [t.ops.new_cache(model.cfg, model.kv_spec) for _ in prompts]
    got = forward_batch(t, [Segment(ids, c) for ids, c in zip(prompts, together)])
    for ids, g, a, c in zip(prompts, got, alone, together):
        np.testing.assert_array_equal(g, t.forward(ids, np.arange(len(ids)), a))
        a.n_past = c.n_past = len(ids)
    for a, c in zip(alone, together):  # the caches hold the same: the next token's logits agree
        token = np.array([5])
        position = np.array([a.n_past])
        np.testing.assert_array_equal(t.forward(token, position, c), t.forward(token, position, a))


def test_waiting_prompts_prefill_together(qwen):
    """Requests whose prompts arrive together prefill in one forward (counted in /metrics) and give the texts
    Model.generate gives alone."""
    prompts = [" ".join(["word"] * n) + " end" for n in (14, 20, 17)]
    assert min(len(qwen.tokenize(p)) for p in prompts) >= qwen.transformer.ops.rows_independent_from
    want = [qwen.generate(p, max_tokens=6, **GREEDY) for p in prompts]
    with serving(qwen, parallel=3) as url:
        c = client(url)
        with ThreadPoolExecutor(3) as pool:
            got = list(pool.map(lambda p: c.completions.create(model="m", prompt=p, max_tokens=6,
                                                                **GREEDY).choices[0].text, prompts))
        assert got == want
        assert metric(url, "prompts_prefilled_together_total") >= 2


def test_completion_stream_usage_and_logprobs(qwen):
    want = qwen.generate(PROMPTS[0], max_tokens=12, **GREEDY)
    n_prompt = len(qwen.tokenize(PROMPTS[0]))
    with serving(qwen, parallel=1) as url:
        c = client(url)
        r = c.completions.create(model="m", prompt=PROMPTS[0], max_tokens=12, logprobs=3, **GREEDY)
        assert r.choices[0].text == want
        assert r.choices[0].finish_reason == "length"
        assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (n_prompt, 12, n_prompt + 12)
        lp = r.choices[0].logprobs
        assert len(lp.token_logprobs) == 12 and all(x <= 0 for x in lp.token_logprobs)
        # greedy: each chosen token is the most likely one
        assert all(abs(max(top.values()) - x) < 1e-9 for top, x in zip(lp.top_logprobs, lp.token_logprobs))
        chunks = list(c.completions.create(model="m", prompt=PROMPTS[0], max_tokens=12, stream=True,
                                           stream_options={"include_usage": True}, **GREEDY))
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
        # the second request's prompt was held by the slot: all of it but its last token reused
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens == n_prompt - 1
        # a stop string ends the text before it
        stop = want[3:5]
        r = c.completions.create(model="m", prompt=PROMPTS[0], max_tokens=12, stop=[stop], **GREEDY)
        assert r.choices[0].text == want[:want.index(stop)] and r.choices[0].finish_reason == "stop"
        # the raw SSE ends with [DONE]
        with httpx.stream("POST", url + "/v1/completions", json={"prompt": "x", "max_tokens": 2, "stream": True}) as s:
            lines = [line for line in s.iter_lines() if line]
        assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)


def test_chat_matches_generate(gemma4):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    want = gemma4.generate(messages, chat=True, max_tokens=10, **GREEDY)
    n_prompt = len(gemma4.chat_ids(messages))
    with serving(gemma4, parallel=2) as url:
        c = client(url)
        r = c.chat.completions.create(model="m", messages=messages, max_tokens=10, logprobs=True, top_logprobs=2,
                                      **GREEDY)
        assert r.choices[0].message.content == want and r.choices[0].message.role == "assistant"
        assert r.usage.prompt_tokens == n_prompt
        assert len(r.choices[0].logprobs.content) == r.usage.completion_tokens
        chunks = list(c.chat.completions.create(model="m", messages=messages, max_tokens=10, stream=True,
                                                stream_options={"include_usage": True}, **GREEDY))
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want
        assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
        # content parts are text too
        parts = [messages[0], {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]}]
        r = c.chat.completions.create(model="m", messages=parts, max_tokens=10, **GREEDY)
        assert r.choices[0].message.content == want
        models = c.models.list().data
        assert [m.id for m in models] == [gemma4.path.name]


@pytest.fixture(scope="module")
def qwen35(tiny_model):  # a hybrid: its slots' DeltaNet states advance in one forward too
    path, _, _ = tiny_model("qwen35")
    return cupyllm.load(path, device="cpu", ctx=96, progress=False)


@pytest.mark.parametrize("name", ["qwen", "gemma4", "qwen35"])
def test_concurrent_requests_equal_sequential_ones(name, request):
    """4 requests at once on 4 slots: decoded together (more than one sequence per forward, the hybrid's too),
    each text the one Model.generate gives alone (greedy, and seeded sampling)."""
    model = request.getfixturevalue(name)
    settings = [dict(temperature=0), dict(temperature=0), dict(temperature=0.9, seed=7, top_k=0, top_p=1.0,
                                                                min_p=0.0), dict(temperature=0)]
    want = [model.generate(p, max_tokens=16, **s) for p, s in zip(PROMPTS, settings)]
    with serving(model, parallel=4) as url:
        c = client(url)

        def ask(i):
            extra = {k: settings[i][k] for k in ("top_k", "min_p") if k in settings[i]}
            plain = {k: v for k, v in settings[i].items() if k not in extra}
            return c.completions.create(model="m", prompt=PROMPTS[i], max_tokens=16, extra_body=extra or None,
                                        **plain).choices[0].text

        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(ask, range(4)))
        assert got == want
        assert metric(url, "n_busy_slots_per_decode") > 1.0  # steps ran several slots' tokens in one forward
        assert metric(url, "tokens_predicted_total") == 4 * 16
        assert metric(url, "requests_processing") == 0


def test_errors_are_openai_bodies(qwen):
    with serving(qwen, parallel=1, queue_size=0) as url:
        c = client(url)

        def bad(status, call, match):
            with pytest.raises(openai.APIStatusError) as info:
                call()
            assert info.value.status_code == status
            error = info.value.body if "message" in (info.value.body or {}) else info.value.body["error"]
            assert re.search(match, error["message"]), error["message"]
            return info.value

        done = lambda **kw: c.completions.create(model="m", **{"prompt": "x", "max_tokens": 2, **kw})  # noqa: E731
        bad(400, lambda: done(extra_body={"top_k": -1}), "top-k")
        bad(400, lambda: done(top_p=2.0), "top-p")
        bad(400, lambda: c.completions.create(model="m", prompt="x", max_tokens=-5), "max_tokens")
        bad(400, lambda: done(n=2), "n must be 1")
        bad(400, lambda: done(extra_body={"bogus": 1}), "unknown parameter 'bogus'")
        bad(400, lambda: done(temperature="hot"), "temperature")
        too_long = bad(400, lambda: done(prompt=[5] * 200), "exceed the context")
        assert too_long.code == "context_length_exceeded"
        bad(400, lambda: done(prompt=[10 ** 9]), "not in the vocabulary")
        bad(400, lambda: c.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}]),
            "chat_template")
        r = httpx.post(url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
        # the server still serves after all that
        assert done(**GREEDY).choices[0].text == qwen.generate("x", max_tokens=2, **GREEDY)
        # one slot, no queue: a second request while a stream runs is refused with 503 and Retry-After
        with slowed(qwen), httpx.stream("POST", url + "/v1/completions", json=LONG_REQUEST) as s:
            lines = s.iter_lines()  # (held: a dropped iterator closes the response, and the server sees it leave)
            next(line for line in lines if line.startswith("data: "))
            r = httpx.post(url + "/v1/completions", json={"prompt": "b", "max_tokens": 2})
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "server_busy"
        assert metric(url, "requests_rejected_total") == 1
    with serving(qwen, parallel=1, api_key="sesame") as url:
        with pytest.raises(openai.AuthenticationError):
            client(url, api_key="wrong").completions.create(model="m", prompt="x", max_tokens=2)
        assert client(url, api_key="sesame").completions.create(model="m", prompt="x", max_tokens=2).choices
        assert httpx.get(url + "/health").status_code == 200
        assert httpx.get(url + "/slots").status_code == 401


def test_a_client_that_goes_away_frees_its_slot(qwen):
    with serving(qwen, parallel=1) as url:
        with slowed(qwen):
            with httpx.stream("POST", url + "/v1/completions", json=LONG_REQUEST) as s:
                lines = s.iter_lines()  # (held, as above)
                next(line for line in lines if line.startswith("data: "))
                assert httpx.get(url + "/slots").json()[0]["state"] == "processing"
            deadline = time.monotonic() + 10
            while httpx.get(url + "/slots").json()[0]["state"] != "idle":
                assert time.monotonic() < deadline, "the slot stayed busy after its client left"
                time.sleep(0.02)
        assert metric(url, "requests_cancelled_total") == 1
        assert metric(url, "tokens_predicted_total") < LONG_REQUEST["max_tokens"]
        assert client(url).completions.create(model="m", prompt="x", max_tokens=2).choices[0].text is not None


def test_metrics_props_and_slots(qwen):
    with serving(qwen, parallel=2) as url:
        before = metric(url, "prompt_tokens_total"), metric(url, "tokens_predicted_total")
        c = client(url)
        c.completions.create(model="m", prompt=PROMPTS[1], max_tokens=5, **GREEDY)
        n_prompt = len(qwen.tokenize(PROMPTS[1]))
        assert metric(url, "prompt_tokens_total") == before[0] + n_prompt
        assert metric(url, "tokens_predicted_total") == before[1] + 5
        assert metric(url, "kv_cache_tokens") == n_prompt + 4  # (the last token is sampled, never run)
        assert metric(url, "requests_deferred") == 0
        props = httpx.get(url + "/props").json()
        assert props["total_slots"] == 2 and props["n_ctx"] == 96 and props["kv"]["type_k"] == "f16"
        slots = httpx.get(url + "/slots").json()
        assert [s["id"] for s in slots] == [0, 1]
        assert sorted(s["tokens_cached"] for s in slots) == [0, n_prompt + 4]
        assert all(s["state"] == "idle" and s["n_ctx"] == 96 and s["kv_type_v"] == "f16" and s["dca"] is None
                   for s in slots)
        assert json.loads(json.dumps(slots)) == slots


def test_drafting_slots_give_the_same_text(tiny_model):
    """With n-gram drafting on, each slot verifies its drafts in the batched forward: the texts are Model.generate's
    (greedy: the same tokens as without drafting), and the drafting counters show in /metrics."""
    path, _, _ = tiny_model("qwen2")
    model = cupyllm.load(path, device="cpu", ctx=96, progress=False, spec="ngram")
    prompts = ["zz zz zz zz zz", "one two one two one two"]
    want = [model.generate(p, max_tokens=20, **GREEDY) for p in prompts]
    assert want == [model.generate(p, max_tokens=20, spec=False, **GREEDY) for p in prompts]
    with serving(model, parallel=2) as url:
        c = client(url)
        with ThreadPoolExecutor(2) as pool:
            got = list(pool.map(lambda p: c.completions.create(model="m", prompt=p, max_tokens=20, **GREEDY)
                                .choices[0].text, prompts))
        assert got == want
        assert metric(url, "draft_tokens_total") > 0
        assert metric(url, "draft_tokens_accepted_total") <= metric(url, "draft_tokens_total")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gemma", "qwen"])
def test_real_model_concurrent_chats_equal_sequential_ones(name):
    """The real models (Gemma 3 270M, Qwen2.5-Coder-0.5B, Q4_K_M): 4 chats at once on 4 slots, each reply the
    one Model.generate gives alone, greedy."""
    from models import gemma_path, qwen_path

    model = cupyllm.load({"gemma": gemma_path, "qwen": qwen_path}[name](), device="cpu", ctx=512, progress=False)
    questions = ["Why is the sky blue?", "Name three prime numbers.", "What is a GGUF file?", "Say hello in French."]
    chats = [[{"role": "user", "content": q}] for q in questions]
    want = [model.generate(chat, chat=True, max_tokens=24, **GREEDY) for chat in chats]
    with serving(model, parallel=4) as url:
        c = client(url)
        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda chat: c.chat.completions.create(model="m", messages=chat, max_tokens=24,
                                                                       **GREEDY).choices[0].message.content, chats))
        assert got == want
        assert metric(url, "n_busy_slots_per_decode") > 1.0


def test_time_limit_and_shutdown_with_a_stream_running(qwen):
    with serving(qwen, parallel=1, time_limit=0.3) as url, slowed(qwen):
        r = client(url).completions.create(model="m", prompt=LONG_REQUEST["prompt"], max_tokens=60, **GREEDY)
        assert r.choices[0].finish_reason == "length" and 0 < r.usage.completion_tokens < 60
    # shutdown while a stream runs: the stream still ends with [DONE], and the server stops
    received = []
    with slowed(qwen):
        with serving(qwen, parallel=1) as url:
            def read():
                with httpx.stream("POST", url + "/v1/completions", json=LONG_REQUEST, timeout=30) as s:
                    received.extend(line for line in s.iter_lines() if line)
            reader = threading.Thread(target=read)
            reader.start()
            deadline = time.monotonic() + 10
            while metric(url, "requests_processing") == 0:
                assert time.monotonic() < deadline
                time.sleep(0.02)
        reader.join(timeout=30)
    assert received[-1] == "data: [DONE]"


def test_a_prompt_goes_to_the_slot_holding_its_prefix(qwen):
    first, other = list(range(5, 26)), list(range(40, 61))
    longer = first + [70, 71, 72]
    want = qwen.generate(longer, max_tokens=6, **GREEDY)
    with serving(qwen, parallel=2) as url:
        c = client(url)
        for prompt in (first, other):  # slot 0 holds `first`, slot 1 `other` (the one used longest ago gets it)
            c.completions.create(model="m", prompt=prompt, max_tokens=6, **GREEDY)
        r = c.completions.create(model="m", prompt=longer, max_tokens=6, **GREEDY)
        assert r.choices[0].text == want
        assert r.usage.prompt_tokens_details.cached_tokens == len(first)
        assert metric(url, "prompt_tokens_cached_total") == len(first)
        assert sorted(s["tokens_cached"] for s in httpx.get(url + "/slots").json()) == [len(other) + 5,
                                                                                     len(longer) + 5]


def test_slots_save_restore_and_erase(qwen, tmp_path):
    """llama-server's slot actions: a saved slot restored into an emptied one serves the next request from its
    cache (only the rest prefilled, the same text); the file is a prompt cache Model.generate reads; errors."""
    from cupyllm.kv.prompt_cache import PromptCache

    first = PROMPTS[1]
    follow_up = first + " and more words here"
    want = qwen.generate(follow_up, max_tokens=6, **GREEDY)
    with serving(qwen, parallel=1, slot_save_path=tmp_path) as url:
        c = client(url)
        c.completions.create(model="m", prompt=first, max_tokens=4, **GREEDY)
        held = httpx.get(url + "/slots").json()[0]["tokens_cached"]
        saved = httpx.post(url + "/slots/0?action=save", json={"filename": "first.slot"}).json()
        assert saved["n_saved"] == held > 0 and saved["n_written"] == (tmp_path / "first.slot").stat().st_size
        assert httpx.post(url + "/slots/0?action=erase").json() == {"id_slot": 0, "n_erased": held}
        assert httpx.get(url + "/slots").json()[0]["tokens_cached"] == 0
        assert httpx.post(url + "/slots/0?action=restore", json={"filename": "first.slot"}).json()["n_restored"] == held
        reply = c.completions.create(model="m", prompt=follow_up, max_tokens=6, **GREEDY)
        assert reply.choices[0].text == want
        assert reply.usage.prompt_tokens_details.cached_tokens == len(qwen.tokenize(first))  # (the prompt part)
        for path, body, status in [("/slots/0?action=save", {"filename": "../x"}, 400),
                                   ("/slots/0?action=save", {"filename": ".hidden"}, 400),
                                   ("/slots/0?action=save", {}, 400),
                                   ("/slots/0?action=restore", {"filename": "absent.slot"}, 400),
                                   ("/slots/3?action=erase", None, 400),
                                   ("/slots/0?action=compact", None, 400)]:
            response = httpx.post(url + path, json=body)
            assert response.status_code == status and response.json()["error"]["message"], path
        with slowed(qwen), httpx.stream("POST", url + "/v1/completions", json=LONG_REQUEST) as s:
            lines = s.iter_lines()  # (held, as above)
            next(line for line in lines if line.startswith("data: "))
            busy = httpx.post(url + "/slots/0?action=save", json={"filename": "busy.slot"})
            assert busy.status_code == 409 and busy.json()["error"]["code"] == "slot_busy"
    cached = PromptCache.load(tmp_path / "first.slot")
    assert qwen.generate(follow_up, max_tokens=6, prompt_cache=cached, **GREEDY) == want
    other = cupyllm.load(qwen.path, device="cpu", ctx=64, progress=False)  # other settings: refused
    with serving(other, parallel=1, slot_save_path=tmp_path) as url:
        response = httpx.post(url + "/slots/0?action=restore", json={"filename": "first.slot"})
        assert response.status_code == 400 and "other settings" in response.json()["error"]["message"]
    with serving(qwen, parallel=1) as url:
        assert httpx.post(url + "/slots/0?action=erase").status_code == 501


def test_slot_save_path_that_cannot_be_made_is_one_error(tiny_model, capsys):
    from cupyllm.cli import main

    path, _, _ = tiny_model("qwen2")
    assert main(["serve", "-m", str(path), "--slot-save-path", "/dev/null/slots"]) == 1
    assert "--slot-save-path /dev/null/slots" in capsys.readouterr().err


def test_a_slot_drafting_for_itself_runs_the_stored_layers(tiny_model):
    """As Model.generate's: a layer plan's self-drafter drafts with the stored layers, not the plan's."""
    import warnings

    from cupyllm.server.engine import Engine

    path, _, _ = tiny_model("qwen2")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="repeat_layers")  # (a 3-layer model: every block is near an end)
        model = cupyllm.load(path, device="cpu", ctx=96, progress=False, repeat_layers="1,2",
                             spec={"type": "self", "draft_max": 4, "adaptive": False})
    engine = Engine(model, parallel=1)
    try:
        drafter = engine._drafter(engine.slots[0], model.spec)
        assert len(drafter.cache.layers) == model.cfg.n_stored_layer == 3 and model.cfg.n_layer == 4
    finally:
        engine.close()
    want = model.generate("one two one two", max_tokens=12, spec=False, **GREEDY)
    with serving(model, parallel=1) as url:
        got = client(url).completions.create(model="m", prompt="one two one two", max_tokens=12, **GREEDY)
    assert got.choices[0].text == want


def test_a_segment_without_room_fails_alone(qwen):
    """The batcher's forward of several segments: one whose cache has no room for its tokens gets the context
    error, the others their logits (as each alone), and nothing runs for the one that failed."""
    from cupyllm.errors import ContextOverflowError
    from cupyllm.server.engine import Engine, _Job

    engine = Engine(qwen, parallel=3)
    try:
        full, a, b = (slot.cache for slot in engine.slots)
        full.n_past = full.spec.ctx - 1
        rng = np.random.default_rng(3)
        prompts = [rng.integers(3, qwen.cfg.n_vocab, size=n) for n in (12, 12, 15)]
        jobs = [_Job(segment=Segment(ids, c), prompt=True) for ids, c in zip(prompts, (full, a, b))]
        engine._forward_together(jobs)
        assert isinstance(jobs[0].error, ContextOverflowError) and jobs[0].result is None
        for job, ids in zip(jobs[1:], prompts[1:]):
            assert job.error is None
            alone = qwen.transformer.ops.new_cache(qwen.cfg, qwen.kv_spec)
            np.testing.assert_array_equal(job.result, qwen.transformer.forward(ids, np.arange(len(ids)), alone))
    finally:
        engine.close()



def test_the_server_warms_the_model_up_before_serving():
    """The server starts serving once its batcher has run one token through the model (the real Gemma 3 270M):
    the CPU backend's weights are interleaved by then (where the machine's rows interleave), not in the first
    request, and the slots' caches are empty again; a request then gives what Model.generate gives."""
    from cupyllm.ops import simd
    model = cupyllm.load(gemma_path(), device="cpu", ctx=64, progress=False)
    want = model.generate("The three primary colours are", max_tokens=6, **GREEDY)
    fresh = cupyllm.load(gemma_path(), device="cpu", ctx=64, progress=False)
    with serving(fresh, parallel=2) as url:
        interleaved = [x16 for _, x16 in fresh.transformer.ops._x16.values() if x16 is not None]
        assert bool(interleaved) == simd.MACHINE_HAS_512_BIT_LANES
        slots = httpx.get(f"{url}/slots").json()
        assert [slot["tokens_cached"] for slot in slots] == [0, 0]
        got = client(url).completions.create(model="m", prompt="The three primary colours are", max_tokens=6,
                                             **GREEDY).choices[0].text
    assert got == want
