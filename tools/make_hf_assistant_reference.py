"""Reference outputs of HF transformers' Gemma 4 assistant (Gemma4AssistantForCausalLM, MTP drafting) for the tiny
random-weight target and assistants of tests/support/make_tiny_models.py, stored so the test suite needs neither
torch nor transformers.

    pip install -e ".[reference]"
    python tools/make_hf_assistant_reference.py      # writes tests/data/hf_reference_gemma4_assistant.npz

For the target and each assistant (`plain`: every token scored; `masked`: the E-series' masked embedder): the
sha256 of its GGUF; the prompt ids; transformers' target hidden rows (normed output) and K/V of its last sliding
and last global layers (`shared_kv_states`, full length); and for each draft start position P, three chained
assistant steps as SinglePositionMultiTokenCandidateGenerator runs them (the target's embedding of the token at P
and its hidden row at P - 1, then each step's argmax and projected state; the K/V of positions < P): logits,
projected states and tokens. Then greedy `generate(..., assistant_model=...)` and plain greedy `generate` token
ids. tests/test_gemma4_assistant.py recomputes all of it where torch is installed.
"""
from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "support"))  # make_tiny_models

import make_tiny_models  # noqa: E402

OUT = ROOT / "tests" / "data" / "hf_reference_gemma4_assistant.npz"
PROMPT_TOKENS, PROMPT_SEED = 14, 11  # longer than the sliding window (6) + 2: the assistant's window is crossed
STARTS = (3, 9, 13)  # draft start positions P (the pending token's): before, at and past the window
STEPS = 3  # chained drafts per start
GENERATE_PROMPT = 9  # the generate() test's prompt: the first 9 prompt ids
NEW_TOKENS = 12
VARIANTS = ("plain", "masked")


def prompt_ids(n_vocab: int) -> list[int]:
    return np.random.default_rng(PROMPT_SEED).integers(3, n_vocab, PROMPT_TOKENS).tolist()


def write_models(directory: Path) -> dict:
    """{'target': (path, decoded), 'plain': ..., 'masked': ...} written into `directory`."""
    out = {}
    target_spec = make_tiny_models.assistant_target_spec()
    path = directory / "tiny-gemma4-assistant-target.gguf"
    out["target"] = (path, make_tiny_models.write_gguf(target_spec, path))
    for variant in VARIANTS:
        spec = make_tiny_models.assistant_spec(masked=variant == "masked")
        path = directory / f"tiny-gemma4-assistant-{variant}.gguf"
        out[variant] = (path, make_tiny_models.write_assistant_gguf(spec, path))
    return out


def compute(directory: Path) -> dict[str, np.ndarray]:
    import torch

    torch.manual_seed(0)
    models = write_models(directory)
    out = {f"{name}_sha256": np.array(hashlib.sha256(path.read_bytes()).hexdigest())
           for name, (path, _) in models.items()}
    target_spec = make_tiny_models.assistant_target_spec()
    target = make_tiny_models.hf_model(target_spec, models["target"][1])
    n_vocab = models["target"][1]["token_embd.weight"].shape[0]
    ids = prompt_ids(n_vocab)
    out["prompt_ids"] = np.array(ids, np.int64)
    with torch.no_grad():
        run = target(torch.tensor([ids]), output_hidden_states=True, return_shared_kv_states=True, use_cache=False)
        hidden = run.hidden_states[-1][0]  # [n, d]: the normed output rows
        shared = run.shared_kv_states
        out["target_hidden"] = hidden.numpy().astype(np.float32)
        for kind, (k, v) in shared.items():  # [1, n_kv, n, hd] -> [n, n_kv, hd]
            out[f"target_{kind}_k"] = k[0].transpose(0, 1).numpy().astype(np.float32)
            out[f"target_{kind}_v"] = v[0].transpose(0, 1).numpy().astype(np.float32)
        embed = target.get_input_embeddings()
        for variant in VARIANTS:
            spec = make_tiny_models.assistant_spec(masked=variant == "masked")
            assistant = make_tiny_models.hf_assistant_model(spec, models[variant][1])
            logits_all, states_all, tokens_all = [], [], []
            for start in STARTS:
                token = torch.tensor([[ids[start]]])
                state = hidden[start - 1][None, None]
                kv = {kind: (k[:, :, :start], v[:, :, :start]) for kind, (k, v) in shared.items()}
                logits_run, states_run, tokens_run = [], [], []
                for _ in range(STEPS):
                    step = assistant(inputs_embeds=torch.cat([embed(token), state], dim=-1),
                                     attention_mask=torch.ones(1, start + 1, dtype=torch.long),
                                     position_ids=torch.tensor([[start]]), shared_kv_states=kv, use_cache=False)
                    token = step.logits.argmax(dim=-1)
                    state = step.last_hidden_state
                    logits_run.append(step.logits[0, 0].numpy())
                    states_run.append(state[0, 0].numpy())
                    tokens_run.append(int(token))
                logits_all.append(logits_run)
                states_all.append(states_run)
                tokens_all.append(tokens_run)
            out[f"{variant}_logits"] = np.array(logits_all, np.float32)  # [start, step, n_vocab]
            out[f"{variant}_states"] = np.array(states_all, np.float32)  # [start, step, d_target]
            out[f"{variant}_tokens"] = np.array(tokens_all, np.int64)
            prompt = torch.tensor([ids[:GENERATE_PROMPT]])
            assisted = target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW_TOKENS,
                                       do_sample=False, assistant_model=assistant, pad_token_id=0)
            out[f"{variant}_generate_ids"] = assisted[0, GENERATE_PROMPT:].numpy().astype(np.int64)
        plain = target.generate(torch.tensor([ids[:GENERATE_PROMPT]]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                pad_token_id=0)
        out["greedy_ids"] = plain[0, GENERATE_PROMPT:].numpy().astype(np.int64)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        arrays = compute(Path(tmp))
    np.savez_compressed(args.out, **arrays)
    print(f"wrote {args.out}: {', '.join(sorted(arrays))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
