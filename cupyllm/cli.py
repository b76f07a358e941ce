"""`cupyllm generate`, `chat`, `info` and `serve`: argument parsing and printing; the work happens in api.py."""
from __future__ import annotations

import argparse
import codecs
import itertools
import os
import sys
import time
import warnings

from .errors import CupyllmError, InputError


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", help="GGUF model path: Qwen2/2.5, Qwen3 (dense or MoE), Gemma 3 or Gemma 4 "
                                          "(default: Gemma 3 270M Q4_K_M from its PyPI package)")
    p.add_argument("-c", "--ctx", type=int, default=None,
                   help="context length: KV positions to hold (default 4096, or the trained context if shorter)")
    p.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto")
    p.add_argument("-t", "--threads", type=int, default=None,
                   help="CPU threads for the CPU backend's matmuls and attention (default: every core)")
    _add_kv_type_args(p)
    p.add_argument("--kv-mirror", action=argparse.BooleanOptionalAction, default=None,
                   help="CPU: also keep a float32 copy of the decoded KV cache (4 bytes more per value; decode "
                        "steps read it instead of decoding the rows: faster with turbo/TCQ types, not with f16 or "
                        "q8_0; docs/kv-formats.md). Default: off, "
                        "the cache takes its KV type's bytes")
    p.add_argument("--cache-normalize-k", action=argparse.BooleanOptionalAction, default=None,
                   help="store K as (K - mean) / scale per channel, balanced against the queries (default: on for "
                        "quantized -ctk types); much better quantized K where some channels of K are large (Qwen2.5)")
    p.add_argument("--dca", action="store_true", help="Dual Chunk Attention: contexts past the trained length")
    _add_repeat_layers_arg(p)
    p.add_argument("--dca-chunk-size", type=int, help="DCA chunk size S (default: the trained context length)")
    p.add_argument("--dca-local-size", type=int, help="DCA local size W (default: S / 32)")
    p.add_argument("--dca-yarn-factor", type=float, default=1.0, help="YaRN attention scaling factor (1 = off)")


def _add_repeat_layers_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repeat-layers", metavar="I,J[;K,L]", default=None,
                   help="run each block [I, J) of layers again right after its first run, weights shared (RYS; "
                        "`cupyllm rys-probe` ranks blocks; docs/layer-plans.md)")


def _add_kv_type_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-ctk", "--cache-type-k", default="f16",
                   help="KV-cache type of K (f16, q8_0, q4_0, turbo3, ...; auto: the best that fits --kv-budget)")
    p.add_argument("-ctv", "--cache-type-v", default="f16", help="KV-cache type of V (auto with -ctk auto)")
    p.add_argument("--kv-budget", help="memory the KV cache may take, e.g. 6GiB (with -ctk/-ctv auto: pick the "
                                       "types by it; default there: the free memory after the weights, less 10%%)")
    p.add_argument("--kv-spill", action="store_true", help="GPU: keep the newest positions of a cache over the "
                                                           "budget on the device, the rest in pinned host memory")
    p.add_argument("--kv-window", type=int, default=0, metavar="N",
                   help="keep the newest N positions of each global layer in -ctk/-ctv and older ones in the tail "
                        "types -ctkt/-ctvt (docs/kv-formats.md)")
    p.add_argument("-ctkt", "--cache-type-k-tail", default=None, help="KV-cache type of K past --kv-window (or of "
                                                                       "a spilled cache's host part)")
    p.add_argument("-ctvt", "--cache-type-v-tail", default=None, help="KV-cache type of V past --kv-window")
    p.add_argument("--kv-spill-max-slowdown", metavar="F", default=None,
                   help="with -ctk auto -ctv auto --kv-spill: keep the best tier whose decode slowdown, predicted "
                        "from rates timed at load, is at most F (default 0.20), spilled, instead of the first that "
                        "fits whole (docs/kv-formats.md)")


def _add_sampling_args(p: argparse.ArgumentParser, max_tokens: int = 128) -> None:
    p.add_argument("-n", "--max-tokens", type=int, default=max_tokens,
                   help=f"tokens to generate (default {max_tokens}; -1: until end of generation or a full context)")
    p.add_argument("--temp", type=float, default=0.8, help="temperature; 0 = greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--min-p", type=float, default=0.05)
    p.add_argument("--repeat-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None, help="random seed (default, or -1: random)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def _add_context_shift_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("context shift (a full context goes on instead of ending; docs/context-shift.md)")
    g.add_argument("--context-shift", action="store_true",
                   help="when the context is full, drop --discard tokens after the first --keep, re-rope the rest and "
                        "go on (default: off, a full context ends the generation)")
    g.add_argument("--keep", type=int, default=0,
                   help="prompt tokens a context shift keeps after the first, which always stays (BOS, or the "
                        "attention sink of a model without one) (default 0; -1: the whole prompt)")
    g.add_argument("--discard", type=int, default=0,
                   help="tokens a context shift drops (default 0: half of those not kept)")


def _add_spec_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculative decoding (the same text, sooner where drafts are kept; docs/speculative.md)")
    g.add_argument("--spec-type", choices=("ngram", "draft", "self", "mtp", "assistant"), default=None,
                   help="draft with: ngram (prompt lookup in the text so far), draft (the -md model), mtp (the model "
                        "file's own NextN head: Qwen3.5 / Qwen3-Next GGUFs converted with it), assistant (the -md "
                        "Gemma 4 assistant: picked by the file), self (the model "
                        "itself: a check of the loop). Default: draft with -md, else none")
    g.add_argument("-md", "--model-draft", metavar="FILE", help="draft model GGUF of the same vocabulary")
    g.add_argument("--draft-max", type=int, default=16, help="most tokens drafted per step (default 16)")
    g.add_argument("--draft-min", type=int, default=0,
                   help="fewest tokens drafted once drafting (default 0: stop drafting where drafts do not pay)")
    g.add_argument("--draft-p-min", type=float, default=0.75,
                   help="a draft model stops drafting where its top token's probability is below this (default 0.75)")
    g.add_argument("--draft-fixed", action="store_true",
                   help="always draft --draft-max tokens (default: as many as the measured acceptance pays for)")
    g.add_argument("--spec-ngram-size", type=int, default=3, help="longest n-gram looked up (default 3)")
    g.add_argument("--spec-ngram-min", type=int, default=2, help="shortest n-gram looked up (default 2)")
    g.add_argument("-ctkd", "--cache-type-k-draft", default="f16", help="KV-cache type of K of the draft model")
    g.add_argument("-ctvd", "--cache-type-v-draft", default="f16", help="KV-cache type of V of the draft model")


def _spec_options(args):
    """The speculative-decoding flags as load()'s spec (None: no drafting)."""
    from .speculative import SpecConfig

    if not hasattr(args, "spec_type"):
        return None
    kind = args.spec_type or ("draft" if args.model_draft else None)
    if kind is None:
        return None
    return SpecConfig(type=kind, draft_max=args.draft_max, draft_min=args.draft_min, draft_p_min=args.draft_p_min,
                      ngram_size=args.spec_ngram_size, ngram_min=args.spec_ngram_min, adaptive=not args.draft_fixed)


def _add_chat_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt-encoding", default="utf-8", metavar="ENCODING",
                   help="text encoding of the prompt file and standard input (default utf-8; e.g. latin-1, cp1252)")
    p.add_argument("--system", help="system prompt of the conversation")
    p.add_argument("--think", action=argparse.BooleanOptionalAction, default=None,
                   help="set the chat template's enable_thinking (Qwen3, Gemma 4); default: the template's own")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cupyllm", description="Long-context LLM inference for Gemma and Qwen GGUF models")
    parser.add_argument("--version", action="version", version=f"cupyllm {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="continue a prompt (or chat with --chat)")
    gen.add_argument("prompt", nargs="?", help="prompt text (default: read standard input)")
    gen.add_argument("-p", "--prompt", dest="prompt_opt", help="prompt text (llama.cpp spelling)")
    gen.add_argument("-f", "--file", help="read the prompt from a file")
    _add_model_args(gen)
    _add_sampling_args(gen)
    _add_context_shift_args(gen)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    _add_chat_args(gen)
    _add_spec_args(gen)
    gen.add_argument("--prompt-cache", metavar="FILE",
                     help="keep the prompt's KV cache in FILE; a later prompt that begins the same way prefills "
                          "only the rest (llama.cpp's flag; made again when the model or KV settings differ)")

    chat = sub.add_parser("chat", help="a conversation: one user turn a line of standard input (/exit or end of "
                                       "input ends it); each turn prefills only what the conversation added")
    _add_model_args(chat)
    _add_sampling_args(chat, max_tokens=512)
    _add_context_shift_args(chat)
    _add_chat_args(chat)
    _add_spec_args(chat)

    info = sub.add_parser("info", help="architecture, shapes, tensor types and memory of a model")
    info.add_argument("model", nargs="?", help="GGUF model path (default: the default model)")
    info.add_argument("-c", "--ctx", type=int, default=4096, help="context length to size the KV cache for")
    _add_kv_type_args(info)
    info.add_argument("--cache-normalize-k", action=argparse.BooleanOptionalAction, default=None)
    info.add_argument("--kv-tiers", action="store_true", help="list every KV tier's cache size at -c and its quality")
    _add_repeat_layers_arg(info)

    probe = sub.add_parser("rys-probe", help="rank blocks of layers to repeat (--repeat-layers) by perplexity and a "
                                              "task battery; docs/layer-plans.md")
    probe.add_argument("model", nargs="?", help="GGUF model path (default: the default model)")
    probe.add_argument("--band", default="auto",
                       help="layers lo,hi the blocks lie in (default auto: all but max(3, layers / 8) at each end)")
    probe.add_argument("--widths", default="auto", help="block widths, e.g. 1,2,4 (default auto: 1, 2, 4, ... up to "
                                                        "half the band)")
    probe.add_argument("--top-k", type=int, default=10, help="ranked blocks to print (default 10)")
    probe.add_argument("--corpus", metavar="FILE", help="UTF-8 text to score perplexity on (default: the shipped "
                                                        "corpus, cupyllm/data/rys/corpus.txt)")
    probe.add_argument("--json", metavar="FILE", help="also write every score and the chosen plans as JSON")
    probe.add_argument("-c", "--ctx", type=int, default=2048, help="context length (default 2048)")
    probe.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto")
    probe.add_argument("-t", "--threads", type=int, default=None)

    sub.add_parser("compile", help="compile the CPU kernels into numba's cache now (a first CPU run does it itself)")

    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, "
                                         "/props, /slots, /metrics; docs/server.md; needs the `serve` extra)")
    _add_model_args(serve)
    _add_spec_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    serve.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    serve.add_argument("-np", "--parallel", type=int, default=1,
                       help="slots: requests decoded together, each with its own KV cache of -c positions (default 1)")
    serve.add_argument("--queue", type=int, default=16,
                       help="requests that may wait for a slot; more are refused with 503 (default 16)")
    serve.add_argument("--timeout", type=float, default=None,
                       help="seconds a request may run before it ends with finish_reason length (default: none)")
    serve.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY")
    serve.add_argument("-a", "--alias", default=None, help="model name /v1/models reports (default: the file name)")
    serve.add_argument("--slot-save-path", metavar="DIR", default=None,
                       help="folder where POST /slots/ID?action=save|restore writes and reads slot caches (prompt "
                            "cache files; default: no slot actions)")
    return parser


def _version() -> str:
    """The installed package's version; the source tree's where it is not installed."""
    from importlib import metadata
    try:
        return metadata.version("cupyllm")
    except metadata.PackageNotFoundError:
        from . import __version__
        return __version__


def _decode(data: bytes, source: str, encoding: str) -> str:
    """Prompt bytes as text; InputError naming the byte that is not `encoding`, and its position."""
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as exc:
        raise InputError(f"{source} is not {encoding} text: byte 0x{data[exc.start]:02x} at byte position "
                         f"{exc.start} ({exc.reason}); convert it to UTF-8, or name its encoding with "
                         "--prompt-encoding (e.g. --prompt-encoding latin-1)") from None


def _read_stdin() -> bytes | str:
    """Standard input as bytes (decoded by --prompt-encoding, like a file); as text where it has no byte
    stream (an embedding that replaced sys.stdin)."""
    return sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read()


def _prompt_text(args) -> str:
    if args.file:
        try:
            with open(args.file, "rb") as fh:
                data = fh.read()
        except OSError as exc:
            raise InputError(f"cannot read prompt file {args.file}: {exc.strerror}") from None
        return _decode(data, f"prompt file {args.file}", args.prompt_encoding)
    for text in (args.prompt_opt, args.prompt):
        if text is not None:  # bytes the shell passed that are not UTF-8 arrive as lone surrogates
            return _decode(os.fsencode(text), "the prompt argument", args.prompt_encoding) \
                if _has_surrogates(text) else text
    if sys.stdin.isatty():
        raise InputError("no prompt: pass it as an argument, with -p/-f, or on standard input")
    data = _read_stdin()
    return data if isinstance(data, str) else _decode(data, "standard input", args.prompt_encoding)


def _has_surrogates(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _check_flags(args) -> None:
    """Every flag checked before the prompt is read or the model loads, in the words the Python API uses."""
    from .api import check_load_options
    from .generate import check_max_tokens
    from .kv.plan import parse_bytes
    from .sampling import SamplingParams

    check_load_options(ctx=args.ctx, threads=getattr(args, "threads", None), dca=_dca_options(args))
    if getattr(args, "kv_budget", None) is not None:
        parse_bytes(args.kv_budget)
    if getattr(args, "kv_spill_max_slowdown", None) is not None:
        from .kv.spill_cost import check_max_slowdown
        check_max_slowdown(args.kv_spill_max_slowdown)
    if hasattr(args, "max_tokens"):
        check_max_tokens(args.max_tokens)
        SamplingParams(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                       repeat_penalty=args.repeat_penalty, seed=args.seed)
    for name in ("keep", "discard"):
        value, low = getattr(args, name, 0), -1 if name == "keep" else 0
        if value < low:
            raise InputError(f"--{name} must be a count >= {low}, got {value}")
    spec = _spec_options(args)
    if spec is not None and spec.type == "draft" and not args.model_draft:
        raise InputError("--spec-type draft needs a draft model: -md/--model-draft FILE")
    if hasattr(args, "prompt_encoding"):
        try:
            codecs.lookup(args.prompt_encoding)
        except LookupError:
            raise InputError(f"--prompt-encoding {args.prompt_encoding}: no such text encoding (utf-8, latin-1, "
                             "cp1252, ...)") from None


def _dca_options(args) -> dict | None:
    """--dca and its sizes as load()'s dca argument; any DCA flag turns it on (a size of 0 is checked, not
    taken for "unset")."""
    if not hasattr(args, "dca"):
        return None
    sizes = (args.dca_chunk_size, args.dca_local_size)
    if args.dca or any(size is not None for size in sizes) or args.dca_yarn_factor != 1.0:
        return {"chunk_size": args.dca_chunk_size, "local_size": args.dca_local_size,
                "yarn_factor": args.dca_yarn_factor}
    return None


def _load_model(args):
    from .api import load

    dca = _dca_options(args)
    model = load(args.model, device=args.device, ctx=args.ctx, kv_type_k=args.cache_type_k,
                 kv_type_v=args.cache_type_v, dca=dca, kv_normalize_k=args.cache_normalize_k, kv_budget=args.kv_budget,
                 kv_spill=args.kv_spill, kv_spill_max_slowdown=getattr(args, "kv_spill_max_slowdown", None),
                 kv_mirror=args.kv_mirror, threads=args.threads, **_kv_window_options(args),
                 spec=_spec_options(args), draft_model=getattr(args, "model_draft", None),
                 draft_kv_type_k=getattr(args, "cache_type_k_draft", "f16"),
                 draft_kv_type_v=getattr(args, "cache_type_v_draft", "f16"), repeat_layers=args.repeat_layers)
    for plan in (model.kv_plan, model.spill_plan):
        if plan is not None:
            print(f"[{model.device}] {plan.describe()}", file=sys.stderr)
    if model.kv_spec.has_tail:
        from .kv.plan import describe_tail
        print(f"[{model.device}] {describe_tail(model.kv_spec)}", file=sys.stderr)
    return model


def _kv_window_options(args) -> dict:
    return dict(kv_window=args.kv_window, kv_type_k_tail=args.cache_type_k_tail,
                kv_type_v_tail=args.cache_type_v_tail)


def _sampling(args) -> dict:
    return dict(max_tokens=args.max_tokens, temperature=args.temp, top_k=args.top_k, top_p=args.top_p,
                min_p=args.min_p, repeat_penalty=args.repeat_penalty, seed=args.seed, stop=args.stop,
                chat_template_kwargs=None if args.think is None else {"enable_thinking": args.think},
                context_shift=args.context_shift, keep=args.keep, discard=args.discard)


def _print_stats(model, prompt_cache=None, prefill_seconds: float = 0.0) -> None:
    """The generation's speed line; with a prompt cache made just before (cache_prompt did that prefill), its
    tokens and time count as the prefill."""
    from .backend import compile_notice
    stats = model.last_stats
    if prompt_cache is not None:
        stats.prompt_tokens = len(prompt_cache.ids) - prompt_cache.reused
        stats.cached_tokens, stats.prefill_seconds = prompt_cache.reused, prefill_seconds
    compiled = " (these times include compiling the CPU kernels)" if compile_notice.compiled_this_process() else ""
    print(f"[{model.device}] {stats.summary()}{compiled}", file=sys.stderr)


def cmd_generate(args) -> int:
    """Flags, prompt, model, prompt cache and the generation's own checks all pass before the prompt is echoed."""
    _check_flags(args)
    prompt = _prompt_text(args)
    model = _load_model(args)
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
                   [{"role": "user", "content": prompt}]
        target = messages
    else:
        target = prompt
    sampling = _sampling(args)
    start = time.perf_counter()
    prompt_cache = _prompt_cache(model, args.prompt_cache, target, args.chat, sampling["chat_template_kwargs"]) \
        if args.prompt_cache else None
    prefill_seconds = time.perf_counter() - start
    pieces = model.generate(target, stream=True, chat=args.chat, prompt_cache=prompt_cache, **sampling)
    if not args.chat:
        sys.stdout.write(prompt)
    for piece in pieces:
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    _print_stats(model, prompt_cache, prefill_seconds)
    return 0


def cmd_chat(args) -> int:
    """One user turn a line of standard input; the reply streams to standard output, the turn's speed to
    standard error. Each turn's prompt (the whole conversation in the chat template) reuses the cache the previous
    turn's generation left (its prompt and reply), so only the new line and the template's turn markers are
    prefilled. Ctrl-C ends a reply early."""
    _check_flags(args)
    model = _load_model(args)
    sampling = _sampling(args)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    cached = None
    interactive = sys.stdin.isatty()
    for number in itertools.count(1):
        if interactive:
            print("> ", end="", file=sys.stderr, flush=True)
        line = _read_line(number, args.prompt_encoding)
        if not line or line.strip() in ("/exit", "/quit"):
            return 0
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.rstrip("\n")})
        reply = []
        pieces = model.generate(messages, stream=True, chat=True, prompt_cache=cached, keep_cache=True, **sampling)
        try:
            for piece in pieces:
                sys.stdout.write(piece)
                sys.stdout.flush()
                reply.append(piece)
        except KeyboardInterrupt:
            pass  # the reply so far stands
        finally:
            pieces.close()
        sys.stdout.write("\n")
        sys.stdout.flush()
        messages.append({"role": "assistant", "content": "".join(reply).strip()})
        # (a Ctrl-C inside the model leaves no cache of this turn: the previous turn's still serves)
        cached = model.last_prompt_cache or cached
        _print_stats(model)


def _read_line(number: int, encoding: str) -> str:
    """Line `number` of standard input, decoded by --prompt-encoding ("" at the end of input)."""
    if not hasattr(sys.stdin, "buffer"):
        return sys.stdin.readline()
    return _decode(sys.stdin.buffer.readline(), f"line {number} of standard input", encoding)


def _prompt_cache(model, path: str, target, chat: bool, template_kwargs):
    """--prompt-cache: the cache of this prompt, from the saved one where they begin alike; saved back."""
    from pathlib import Path

    from .kv.prompt_cache import PromptCache

    saved = None
    if Path(path).exists():
        try:
            saved = PromptCache.load(path)
        except CupyllmError as exc:
            print(f"cupyllm: note: {exc}", file=sys.stderr)
        problem = model.prompt_cache_problem(saved) if saved is not None else None
        if problem is not None:  # other settings, or a file damaged or written by hand
            print(f"cupyllm: note: prompt cache {path} {problem}; making it again", file=sys.stderr)
            saved = None
    cached = model.cache_prompt(target, chat=chat, chat_template_kwargs=template_kwargs, reuse=saved)
    if saved is None or cached.ids != saved.ids:
        cached.save(path)
    print(f"[{model.device}] prompt cache {path}: {len(cached.ids)} tokens, {cached.reused} of them from the saved "
          "cache", file=sys.stderr)
    return cached


def cmd_info(args) -> int:
    from .report import model_report

    _check_flags(args)
    print(model_report(args.model, ctx=args.ctx, kv_type_k=args.cache_type_k, kv_type_v=args.cache_type_v,
                       normalize_k=args.cache_normalize_k, kv_budget=args.kv_budget, kv_spill=args.kv_spill,
                       kv_tiers=args.kv_tiers, **_kv_window_options(args), repeat_layers=args.repeat_layers))
    return 0


def cmd_rys_probe(args) -> int:
    """Load the model once, score every block of the band (tqdm), print the ranked table and the two plans."""
    import json

    from .api import check_load_options, load
    from .rys_probe import band_and_widths, corpus_text, probe

    check_load_options(ctx=args.ctx, threads=args.threads)
    if args.top_k < 1:
        raise InputError(f"--top-k must be >= 1, got {args.top_k}")
    corpus = corpus_text(args.corpus)
    model = load(args.model, device=args.device, ctx=args.ctx, threads=args.threads)
    band_and_widths(model.cfg.n_layer, args.band, args.widths)  # (a bad band fails before the first score)
    result = probe(model, band=args.band, widths=args.widths, corpus=corpus)
    print(f"{result.model}: {result.n_layer} layers, blocks of widths {','.join(map(str, result.widths))} in layers "
          f"[{result.band[0]}, {result.band[1]}), perplexity over {result.corpus_tokens} corpus tokens, "
          f"{result.n_tasks} tasks")
    print(result.table(args.top_k))
    if args.json:
        try:
            with open(args.json, "w", encoding="utf-8") as fh:
                json.dump({**result.to_json(), "device": model.device}, fh, indent=1)
        except OSError as exc:
            raise InputError(f"cannot write {args.json}: {exc.strerror}") from None
    return 0


def cmd_compile(args) -> int:
    from .backend import precompile

    seconds = precompile.compile_all()
    print(f"cupyllm: CPU kernels compiled in {seconds:.0f} s, cached in {precompile.cache_dir()}", file=sys.stderr)
    return 0


def cmd_serve(args) -> int:
    """Check the flags, load the model, serve until SIGINT / SIGTERM (uvicorn's graceful shutdown, then the
    slots' streams are cancelled and their threads stopped)."""
    _check_flags(args)
    if args.parallel < 1:
        raise InputError(f"-np/--parallel must be >= 1 slot, got {args.parallel}")
    if args.queue < 0:
        raise InputError(f"--queue must be >= 0, got {args.queue}")
    if not 0 < args.port < 65536:
        raise InputError(f"--port must be 1 .. 65535, got {args.port}")
    try:
        import uvicorn

        from .server import create_app
    except ImportError as exc:
        raise CupyllmError(f"cupyllm serve needs the `serve` extra ({exc.name} is missing): "
                           "pip install 'cupyllm[serve]'") from None
    if args.slot_save_path is not None:
        try:
            os.makedirs(args.slot_save_path, exist_ok=True)
        except OSError as exc:
            raise InputError(f"--slot-save-path {args.slot_save_path}: {exc.strerror}; give a folder you can "
                             "write") from None
    model = _load_model(args)
    app = create_app(model, parallel=args.parallel, api_key=args.api_key, queue_size=args.queue,
                     time_limit=args.timeout, alias=args.alias, slot_save_path=args.slot_save_path)
    print(f"[{model.device}] serving {model.path.name} on http://{args.host}:{args.port}/v1 with {args.parallel} "
          f"slot(s) of {model.kv_spec.ctx} tokens", file=sys.stderr)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=10)
    return 0


def _print_warning(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"cupyllm: warning: {message}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _print_warning  # one line, like the errors, not Python's file:line form
            return {"generate": cmd_generate, "chat": cmd_chat, "info": cmd_info, "rys-probe": cmd_rys_probe,
                    "compile": cmd_compile, "serve": cmd_serve}[args.command](args)
    except CupyllmError as exc:
        print(f"cupyllm: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
