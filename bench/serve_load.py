"""Load on `cupyllm serve` beside llama-cpp-python's OpenAI server and llama.cpp's own llama-server, over
loopback: 1, 2, 4 and 8 concurrent clients, each sending streamed greedy /v1/completions requests one after
another.

    python bench/serve_load.py [--model PATH ...] [--clients 1,2,4,8] [--requests 2] [--max-tokens 48]
                               [--peers cupyllm,llama-cpp-python,llama-server] [--llama-server PATH]
                               [--out bench/results/serve_load.json]

Per server and client count: aggregate decode tokens/s (all completion tokens over the wall time of the level),
time to first token (request sent -> first text chunk) and the inter-token latency (gaps between text chunks
of one stream; a chunk is one token's text but where a token ends inside a UTF-8 character) as p50 / p99.
cupyllm runs with -np = the largest client count (its slots decode together: models/batch.py); llama-cpp-python's
server (llama_cpp.server, its `server` extra: sse-starlette, starlette-context, pydantic-settings;
--interrupt_requests False, else a new request cuts the running one short) decodes one request at a time;
llama.cpp's llama-server (built from the llama.cpp that llama-cpp-python 0.3.36 vendors by
tools/build_llama_server.sh) runs with the same -np, its continuous batching on, and -c = ctx x np (it splits
its context among the slots); both llama.cpp peers keep ggml's default thread polling. On a machine other jobs
load, ggml's two decode threads wait on each other whenever one is descheduled: llama-server's decode of Gemma 3
270M then ranged from 38 to 1,280 ms a token between runs (load average 3-4 on the 2 cores; --poll 0 was no
steadier), so run this on an idle machine. A server that cannot start (a peer not installed or not built) is
skipped with the reason in the JSON. The servers run one after the other on the same 2 cores, THREADS threads
each; other jobs on the machine shift the figures, so compare within one run.
Every level also reports how many of its greedy texts equal the same prompt's text run alone before the
levels (cupyllm's batched forward gives each sequence its own logits, bit for bit up to 8 decode rows a step).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

THREADS = 2
TOPICS = ["the history of the bicycle", "how a refrigerator works", "why leaves change colour", "the rules of chess",
          "how bread rises", "the water cycle", "how a compass works", "the life of a honeybee"]


def prompt_for(client: int, request: int) -> str:
    topic = TOPICS[(client + request) % len(TOPICS)]
    return f"Write a short explanation of {topic} for a curious ten-year-old.\n\n"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PEERS = ("cupyllm", "llama-cpp-python", "llama-server")
# where tools/build_llama_server.sh puts llama.cpp's server by default
LLAMA_SERVER = Path.home() / ".cache" / "cupyllm" / "llama-server-0.3.36" / "bin" / "llama-server"


def server_command(peer: str, model: str, port: int, parallel: int, ctx: int, llama_server: Path) -> list[str]:
    if peer == "cupyllm":
        return [sys.executable, "-m", "cupyllm.cli", "serve", "-m", model, "--port", str(port), "-np", str(parallel),
                "-c", str(ctx), "-t", str(THREADS), "--device", "cpu", "--queue", "64"]
    if peer == "llama-cpp-python":
        return [sys.executable, "-m", "llama_cpp.server", "--model", model, "--port", str(port), "--host",
                "127.0.0.1", "--n_ctx", str(ctx), "--n_threads", str(THREADS), "--n_threads_batch", str(THREADS),
                "--interrupt_requests", "False"]  # (its default: a new request cuts the running one short)
    if peer == "llama-server":
        if not llama_server.is_file():
            raise RuntimeError(f"{llama_server} is not built: bash tools/build_llama_server.sh "
                               "(or --llama-server PATH)")
        return [str(llama_server), "-m", model, "--port", str(port), "--host", "127.0.0.1", "-np", str(parallel),
                "-c", str(ctx * parallel), "-t", str(THREADS), "-tb", str(THREADS), "--no-webui"]
    raise ValueError(f"unknown peer {peer!r}: choose from {', '.join(PEERS)}")


def start_server(peer: str, model: str, port: int, parallel: int, ctx: int,
                 llama_server: Path = LLAMA_SERVER) -> subprocess.Popen:
    cmd = server_command(peer, model, port, parallel, ctx, llama_server)
    log = tempfile.TemporaryFile("w+")  # (a pipe would fill with llama.cpp's load log and block the server)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, text=True, cwd=ROOT)
    proc.log = log
    return proc


def wait_ready(proc: subprocess.Popen, url: str, seconds: float = 300, path: str = "/v1/models") -> None:
    import httpx
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            proc.log.seek(0)
            raise RuntimeError(f"exited with {proc.returncode}: {proc.log.read()[-600:]}")
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("did not answer within the time limit")


def one_request(client, prompt: str, max_tokens: int) -> dict:
    sent = time.perf_counter()
    arrivals, pieces, usage = [], [], None
    stream = client.completions.create(model="m", prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            arrivals.append(time.perf_counter())
            pieces.append(chunk.choices[0].text)
        if getattr(chunk, "usage", None):
            usage = chunk.usage
    tokens = usage.completion_tokens if usage is not None else len(pieces)
    return {"ttft": arrivals[0] - sent if arrivals else None, "gaps": [b - a for a, b in zip(arrivals, arrivals[1:])],
            "tokens": tokens, "text": "".join(pieces), "prompt": prompt}


def run_level(url: str, n_clients: int, n_requests: int, max_tokens: int) -> dict:
    import openai
    results, errors = [], []

    def client_loop(index: int):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
        for r in range(n_requests):
            try:
                results.append(one_request(client, prompt_for(index, r), max_tokens))
            except Exception as exc:  # (recorded, the level goes on)
                errors.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(n_clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    gaps = sorted(g for r in results for g in r["gaps"])
    ttfts = sorted(r["ttft"] for r in results if r["ttft"] is not None)
    tokens = sum(r["tokens"] for r in results)

    def pct(values, q):
        return values[min(len(values) - 1, int(q * len(values)))] if values else None

    return {"clients": n_clients, "requests": len(results), "errors": errors, "wall_s": wall,
            "completion_tokens": tokens, "aggregate_tok_s": tokens / wall if wall else 0.0,
            "ttft_p50_s": pct(ttfts, 0.5), "ttft_p99_s": pct(ttfts, 0.99),
            "itl_p50_ms": 1e3 * pct(gaps, 0.5) if gaps else None, "itl_p99_ms": 1e3 * pct(gaps, 0.99) if gaps else None,
            "texts": [(r["prompt"], r["text"]) for r in results]}


def shown(value, digits: int = 1) -> str:
    """A figure for the log: '-' where there is none (no text arrived: a model whose tokens print nothing, as a
    random-weight model's may, has no time to first text or gaps between texts)."""
    return "-" if value is None else f"{value:.{digits}f}"


def bench_model(model: str, levels: list[int], args) -> dict:
    import openai
    result = {"servers": {}}
    for peer in args.peers.split(","):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = None
        try:
            proc = start_server(peer, model, port, max(levels), args.ctx, Path(args.llama_server))
            # (llama-server answers some routes while its model still loads; /health says 503 until it has)
            wait_ready(proc, url, path="/health" if peer == "llama-server" else "/v1/models")
        except (RuntimeError, OSError) as exc:
            result["servers"][peer] = {"skipped": str(exc)}
            print(f"{peer}: skipped ({exc})", file=sys.stderr)
            if proc is not None:
                proc.kill()
            continue
        try:
            # each prompt alone, one after the other: the reference texts (and the warm-up)
            client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
            alone = {prompt_for(0, i): one_request(client, prompt_for(0, i), args.max_tokens)["text"]
                     for i in range(len(TOPICS))}
            runs = []
            for n in levels:
                level = run_level(url, n, args.requests, args.max_tokens)
                level["same_text_as_alone"] = sum(alone[p] == t for p, t in level.pop("texts"))
                runs.append(level)
                print(f"{Path(model).name[:24]:24s} {peer:17s} {n} clients: {shown(level['aggregate_tok_s'])} tok/s "
                      f"aggregate, TTFT p50 {shown(level['ttft_p50_s'], 3)} s, ITL p50 {shown(level['itl_p50_ms'])} ms "
                      f"p99 {shown(level['itl_p99_ms'])} ms, {level['same_text_as_alone']}/{level['requests']} texts "
                      f"as alone{', errors: ' + str(len(level['errors'])) if level['errors'] else ''}", file=sys.stderr)
            result["servers"][peer] = {"levels": runs}
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    tps = {s: {lv["clients"]: lv["aggregate_tok_s"] for lv in r.get("levels", [])} for s, r in result["servers"].items()}
    if 1 in tps.get("cupyllm", {}):
        result["cupyllm_scaling"] = {n: v / tps["cupyllm"][1] for n, v in tps["cupyllm"].items()}
    for peer, by_level in tps.items():
        if peer != "cupyllm" and tps.get("cupyllm"):
            result[f"cupyllm_vs_{peer}"] = {n: tps["cupyllm"][n] / v for n, v in by_level.items()
                                           if v and n in tps["cupyllm"]}
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", default=None,
                    help="GGUF, repeatable (default: the default model, Gemma 3 270M Q4_K_M)")
    ap.add_argument("--clients", default="1,2,4,8")
    ap.add_argument("--requests", type=int, default=2, help="requests per client per level")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--peers", default=",".join(PEERS))
    ap.add_argument("--llama-server", default=str(LLAMA_SERVER),
                    help="llama.cpp's llama-server binary (default: where tools/build_llama_server.sh puts it)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "serve_load.json"))
    args = ap.parse_args()
    if args.model is None:
        from cupyllm.files.model_store import default_model_path
        args.model = [str(default_model_path())]
    levels = [int(c) for c in args.clients.split(",")]
    from host_cpu import cpu_description
    out = {"max_tokens": args.max_tokens, "requests_per_client": args.requests, "threads": THREADS,
           "host": cpu_description(), "load_average": os.getloadavg(),
           "command": " ".join(["python", "bench/serve_load.py"] + sys.argv[1:]),
           "models": {}}
    for model in args.model:
        out["models"][Path(model).name] = bench_model(model, levels, args)
    out["load_average_after"] = os.getloadavg()
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({name: {k: v for k, v in r.items() if k != "servers"} for name, r in out["models"].items()},
                     indent=1))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
