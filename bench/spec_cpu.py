"""Speculative decoding on the CPU: greedy decode speed of Qwen2.5-Coder-0.5B-Instruct with and without n-gram
drafting, on input-grounded prompts (edit a given function, answer from a given document) and on free text, beside
llama.cpp (llama-cpp-python, n_threads=2) plain and with its own prompt lookup (LlamaPromptLookupDecoding, its
defaults: 10 drafted tokens, 2-grams) on the same prompt tokens, in the same run.

    python bench/spec_cpu.py [--rounds 3] [--max-tokens 192] [--out bench/results/spec_cpu.json]

Decode tok/s counts from the first generated token to the last (the prefill excluded), each engine generating
until its end-of-generation token or --max-tokens. The engines are timed alone, one after the other, in rounds
whose order alternates; each figure is the median over the rounds (all rounds in the JSON). Ratios: a mode's
tok/s over the same engine's plain tok/s; and cupyllm's n-gram over llama.cpp's prompt lookup.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from host_cpu import cpu_description

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

THREADS = 2
FUNCTION = '''def parse_records(lines, separator=","):
    """Parse CSV-like lines into a list of dictionaries keyed by the header row."""
    records = []
    header = None
    for number, line in enumerate(lines):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        fields = [field.strip() for field in line.split(separator)]
        if header is None:
            header = fields
            continue
        if len(fields) != len(header):
            raise ValueError(f"line {number}: expected {len(header)} fields, got {len(fields)}")
        record = {}
        for name, value in zip(header, fields):
            if value.isdigit():
                value = int(value)
            record[name] = value
        records.append(record)
    return records
'''
DOCUMENT = ("Installing the Aurora weather station. First, unpack the base unit and the outdoor sensor and check that "
            "the box holds four AA batteries and a mounting bracket. Second, insert two batteries into the outdoor "
            "sensor, set its channel switch to 1, and close the cover until it clicks. Third, insert the other two "
            "batteries into the base unit and hold the SEARCH button for three seconds until the antenna symbol "
            "flashes. Fourth, place the sensor within 30 metres of the base unit, away from direct sunlight and "
            "metal surfaces. Fifth, wait up to five minutes for the first outdoor reading to appear. If no reading "
            "appears, press SEARCH again and move the sensor closer. The base unit keeps 24 hours of readings and "
            "shows the minimum and maximum temperature of the day when you press MEM.")
PROMPTS = {
    "edit_function": "Rename the variable `records` to `rows` and the parameter `separator` to `sep` in this function. "
                     "Reply with the whole updated function only.\n\n" + FUNCTION,
    "answer_from_document": "Read the manual below and list the five installation steps, quoting each step's "
                            "sentence exactly as the manual words it.\n\n" + DOCUMENT,
    "free_text": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}
GROUNDED = ("edit_function", "answer_from_document")


def _median_tps(runs: list[dict]) -> float:
    return statistics.median(run["decode_tps"] for run in runs)


def cupyllm_engine(path: Path, max_tokens: int):
    import cupyllm
    model = cupyllm.load(path, device="cpu", ctx=2048, threads=THREADS, progress=False)
    ids = {name: model.chat_ids(text) for name, text in PROMPTS.items()}

    def run(name: str, mode: str) -> dict:
        spec = False if mode == "plain" else mode
        t_first = t_last = None
        tokens = 0
        for _ in model.generate(ids[name], max_tokens=max_tokens, temperature=0, stream=True, spec=spec):
            t_last = time.perf_counter()
            t_first = t_first or t_last
        stats = model.last_stats
        tokens = stats.generated_tokens
        # (pieces hold back partial UTF-8 and stop-string prefixes: the decode clock of the stats is the one kept)
        out = {"tokens": tokens, "decode_tps": (tokens - 1) / stats.decode_seconds if tokens > 1 else 0.0}
        if stats.draft is not None:
            d = stats.draft
            out.update(drafted=d.drafted, accepted=d.accepted, acceptance=d.acceptance,
                       tokens_per_forward=d.tokens_per_forward, acceptance_by_position=d.acceptance_by_position())
        return out

    run("free_text", "plain")  # warm up
    return ids, run, ("plain", "ngram")


def llama_cpp_engine(path: Path, max_tokens: int, ids: dict):
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    engines = {
        "plain": Llama(model_path=str(path), n_threads=THREADS, n_threads_batch=THREADS, n_ctx=2048, n_batch=512,
                       verbose=False),
        "prompt_lookup": Llama(model_path=str(path), n_threads=THREADS, n_threads_batch=THREADS, n_ctx=2048,
                               n_batch=512, verbose=False, draft_model=LlamaPromptLookupDecoding()),
    }

    def run(name: str, mode: str) -> dict:
        llm = engines[mode]
        times = []
        for token in llm.generate(ids[name], top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0,
                                  reset=True):
            times.append(time.perf_counter())
            if llm._model.token_is_eog(token) if hasattr(llm._model, "token_is_eog") else token == llm.token_eos():
                break
            if len(times) >= max_tokens:
                break
        tokens = len(times)
        return {"tokens": tokens, "decode_tps": (tokens - 1) / (times[-1] - times[0]) if tokens > 1 else 0.0}

    run("free_text", "plain")  # warm up
    return run, tuple(engines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "spec_cpu.json")
    args = parser.parse_args(argv)
    from models import qwen_path
    path = qwen_path()
    ids, ours, our_modes = cupyllm_engine(path, args.max_tokens)
    theirs, their_modes = llama_cpp_engine(path, args.max_tokens, ids)
    runs: dict = {}
    for rnd in range(args.rounds):
        order = [("cupyllm", ours, our_modes), ("llama.cpp", theirs, their_modes)]
        for engine, run, modes in (order if rnd % 2 == 0 else order[::-1]):
            for prompt in PROMPTS:
                for mode in modes:
                    result = run(prompt, mode)
                    runs.setdefault(prompt, {}).setdefault(engine, {}).setdefault(mode, []).append(result)
                    print(f"round {rnd} {engine:9s} {prompt:20s} {mode:13s} {result['tokens']:4d} tok "
                          f"{result['decode_tps']:6.1f} tok/s" + (f"  kept {result['accepted']}/{result['drafted']}"
                                                                  if "drafted" in result else ""), flush=True)
    summary = {}
    for prompt, engines in runs.items():
        ours_plain, ours_ngram = _median_tps(engines["cupyllm"]["plain"]), _median_tps(engines["cupyllm"]["ngram"])
        their_plain = _median_tps(engines["llama.cpp"]["plain"])
        their_lookup = _median_tps(engines["llama.cpp"]["prompt_lookup"])
        summary[prompt] = {
            "grounded": prompt in GROUNDED,
            "cupyllm_plain_tps": ours_plain, "cupyllm_ngram_tps": ours_ngram,
            "llama_cpp_plain_tps": their_plain, "llama_cpp_prompt_lookup_tps": their_lookup,
            "cupyllm_ngram_speedup": ours_ngram / ours_plain,
            "llama_cpp_prompt_lookup_speedup": their_lookup / their_plain,
            "cupyllm_ngram_over_llama_cpp_prompt_lookup": ours_ngram / their_lookup,
            "cupyllm_ngram_acceptance": statistics.median(r["acceptance"] for r in engines["cupyllm"]["ngram"]),
        }
    result = {"bench": "spec_cpu", "device": cpu_description(), "threads": THREADS, "model": path.name,
              "max_tokens": args.max_tokens, "rounds": args.rounds, "summary": summary, "runs": runs,
              "command": "python bench/spec_cpu.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for prompt, s in summary.items():
        print(f"{prompt:20s} cupyllm ngram x{s['cupyllm_ngram_speedup']:.2f} ({s['cupyllm_ngram_tps']:.1f} tok/s), "
              f"llama.cpp lookup x{s['llama_cpp_prompt_lookup_speedup']:.2f} ({s['llama_cpp_prompt_lookup_tps']:.1f}), "
              f"ours/theirs x{s['cupyllm_ngram_over_llama_cpp_prompt_lookup']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
