"""The generation loop on the tiny models: streaming, stop strings, EOS, seeds, context limits, the CLI."""
from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest

import cupyllm
from cupyllm.errors import ContextOverflowError, CupyllmError
from cupyllm.generate import StopMatcher


@pytest.fixture(scope="module")
def qwen(tiny_model):
    path, _, _ = tiny_model("qwen2")
    return cupyllm.load(path, device="cpu", ctx=64, progress=False)


def feed_all(matcher, pieces):
    return "".join(matcher.feed(p) for p in pieces) + ("" if matcher.stopped else matcher.flush())


def test_stop_matcher_holds_back_partial_matches():
    assert feed_all(StopMatcher(["END"]), ["abc E", "N", "D tail"]) == "abc "
    assert feed_all(StopMatcher(["END"]), ["abc E", "N", "x"]) == "abc ENx"
    assert feed_all(StopMatcher(["\n\n", "###"]), ["a\n", "b#", "##c"]) == "a\nb"
    m = StopMatcher(["xyz"])
    assert m.feed("ab x") == "ab " and m.feed("y") == "" and m.feed("q") == "xyq"


def test_stream_equals_text_and_seed_reproduces(qwen):
    kw = dict(max_tokens=12, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=11)
    text = qwen.generate("the cat", **kw)
    pieces = list(qwen.generate("the cat", stream=True, **kw))
    assert "".join(pieces) == text
    assert qwen.generate("the cat", **kw) == text
    assert qwen.last_stats.generated_tokens >= 1


def test_greedy_continuation_is_argmax_of_logits(qwen):
    ids = qwen.tokenize("in the")
    text = qwen.generate(ids, max_tokens=3, temperature=0.0)
    expected = list(ids)
    for _ in range(3):
        token = int(qwen.logits(expected)[-1].argmax())
        if qwen.tokenizer.is_eog(token):  # end-of-generation tokens end the text and are not printed
            break
        expected.append(token)
    assert text == qwen.detokenize(expected[len(ids):])


def test_stop_string_cuts_output(qwen):
    full = qwen.generate("the cat", max_tokens=16, temperature=0.0)
    if len(full) < 4:
        pytest.skip("continuation too short to cut")
    stop = full[2:4]
    cut = qwen.generate("the cat", max_tokens=16, temperature=0.0, stop=[stop])
    assert cut == full[:full.index(stop)]
    assert qwen.last_stats.stop_reason == "stop string"


def test_context_overflow_is_a_clear_error(qwen):
    with pytest.raises(ContextOverflowError, match="raise -c/--ctx"):
        qwen.logits(list(range(65)))
    out = qwen.generate(list(range(1, 60)), max_tokens=50, temperature=0.0)  # generation stops at the context end
    assert qwen.last_stats.generated_tokens <= 64 - 59
    assert qwen.last_stats.stop_reason in ("context full", "end of generation token")
    assert isinstance(out, str)


def test_max_tokens_minus_one_runs_to_the_end_of_the_context(qwen):
    """llama.cpp's -n -1: no token limit, generation ends at an end-of-generation token or a full context."""
    prompt = list(range(1, 50))
    qwen.generate(prompt, max_tokens=-1, temperature=0.0)
    stats = qwen.last_stats
    if stats.stop_reason == "context full":
        assert stats.generated_tokens == 64 - len(prompt)
    else:
        assert stats.stop_reason == "end of generation token" and stats.generated_tokens <= 64 - len(prompt)
    qwen.generate(prompt, max_tokens=0)
    assert qwen.last_stats.generated_tokens == 0 and qwen.last_stats.stop_reason == "max_tokens"


def test_bad_options(tiny_model):
    path, _, _ = tiny_model("qwen2")
    with pytest.raises(CupyllmError, match="unknown KV format 'q9_9'"):
        cupyllm.load(path, device="cpu", kv_type_k="q9_9", progress=False)
    with pytest.raises(CupyllmError, match="unknown device"):
        cupyllm.load(path, device="tpu", progress=False)
    with pytest.raises(TypeError, match="unknown option"):
        cupyllm.load(path, device="cpu", temprature=0.5, progress=False)


def test_engine_runs_with_quantized_caches(tiny_model):
    """Every step down the ladder costs accuracy: logit error grows as bits per value shrink."""
    path, _, _ = tiny_model("gemma3")
    ids = list(range(4, 24))
    exact = cupyllm.load(path, device="cpu", ctx=32, kv_type_k="f32", kv_type_v="f32", progress=False).logits(ids)
    errors = []
    for kv_type in ["q8_0", "q4_0", "turbo3", "turbo2_tcq"]:
        quant = cupyllm.load(path, device="cpu", ctx=32, kv_type_k=kv_type, kv_type_v=kv_type, progress=False)
        logits = quant.logits(ids)
        assert np.isfinite(logits).all()
        errors.append(np.sqrt(np.mean((logits - exact) ** 2)))
    assert 0.0 < errors[0] < 0.05
    assert errors == sorted(errors), errors


def run_cli(*args, input_text=None):
    return subprocess.run([sys.executable, "-m", "cupyllm.cli", *args], capture_output=True, text=True,
                          input=input_text, timeout=300)


def test_cli_generate_and_info(tiny_model):
    path, _, _ = tiny_model("gemma3")
    out = run_cli("generate", "the sea", "-m", str(path), "-n", "5", "--temp", "0", "--device", "cpu")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("the sea")
    assert "prefill" in out.stderr and "decode" in out.stderr and "tok/s" in out.stderr
    info = run_cli("info", str(path), "-c", "1024")
    assert info.returncode == 0 and "gemma3" in info.stdout and "KV cache" in info.stdout
    assert "normalised" not in info.stdout  # f16 K is stored as computed
    for flags, normalised in ((["-ctk", "q8_0"], True), (["-ctk", "q8_0", "--no-cache-normalize-k"], False)):
        info = run_cli("info", str(path), "-c", "1024", *flags)
        assert info.returncode == 0 and ("K q8_0, normalised" in info.stdout) == normalised, info.stdout


@pytest.mark.parametrize("args,message", [
    (["generate", "hi", "-m", "/no/such/model.gguf"], "no such file"),
    (["generate", "the sea and the sky and the sand", "-m", "{tiny}", "-c", "8"], "exceed the context of 8"),
    (["generate", "hi", "-m", "{tiny}", "-ctv", "q3_x"], "unknown KV format"),
    (["generate", "hi", "-m", "{tiny}", "--top-p", "2"], "top-p 2.0 (need 0 < top-p <= 1"),
    (["generate", "hi", "-m", "{tiny}", "--top-k", "-1", "--repeat-penalty", "0"], "top-k -1 (need >= 0"),
])
def test_cli_errors_are_one_line(tiny_model, args, message):
    path, _, _ = tiny_model("gemma3")
    out = run_cli(*[a.replace("{tiny}", str(path)) for a in args], "--device", "cpu")
    assert out.returncode == 1
    assert message in out.stderr and "Traceback" not in out.stderr


def test_cli_cache_that_cannot_fit_is_one_clear_error(tiny_model):
    path, _, _ = tiny_model("qwen2")  # full-attention layers: the cache grows with the context
    out = run_cli("generate", "hi", "-m", str(path), "-c", str(2**40), "--device", "cpu")
    assert out.returncode == 1
    assert "lower -c/--ctx" in out.stderr and "GiB" in out.stderr and "Traceback" not in out.stderr


def test_a_context_past_the_trained_one_warns_unless_dca(tiny_model):
    """llama.cpp warns when n_ctx exceeds n_ctx_train; so do load() (a ContextPastTrainingWarning, silent with
    DCA or within the trained context) and the CLI (one line)."""
    import warnings

    import cupyllm
    from cupyllm.errors import ContextPastTrainingWarning
    path, spec, _ = tiny_model("qwen2")
    with pytest.warns(ContextPastTrainingWarning, match=f"past the {spec.ctx_train} positions"):
        cupyllm.load(path, device="cpu", ctx=2 * spec.ctx_train, progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ContextPastTrainingWarning)
        cupyllm.load(path, device="cpu", ctx=spec.ctx_train, progress=False)
        cupyllm.load(path, device="cpu", ctx=2 * spec.ctx_train, dca=True, progress=False)
    out = run_cli("generate", "hi", "-m", str(path), "-n", "1", "-c", str(2 * spec.ctx_train), "--device", "cpu")
    assert out.returncode == 0, out.stderr
    assert "cupyllm: warning: ctx" in out.stderr and "--dca" in out.stderr and "Traceback" not in out.stderr
    quiet = run_cli("generate", "hi", "-m", str(path), "-n", "1", "-c", str(2 * spec.ctx_train), "--dca",
                    "--device", "cpu")
    assert quiet.returncode == 0 and "warning" not in quiet.stderr, quiet.stderr


def test_chat_template_variables_reach_the_template(tiny_model, capsys):
    """chat_template_kwargs (API) / --think (CLI) set the template's enable_thinking: the tiny Gemma 4's
    template leaves an empty thought channel in the prompt unless thinking is on."""
    import cupyllm
    from cupyllm.cli import main as cli_main
    path = tiny_model("gemma4")[0]
    model = cupyllm.load(path, device="cpu", ctx=128, progress=False)
    plain = model.tokenizer.decode(model.chat_ids("hi"))
    thinking = model.tokenizer.decode(model.chat_ids("hi", {"enable_thinking": True}))
    assert plain.endswith("<|turn>model\n<|channel>thought\n<channel|>") and thinking.endswith("<|turn>model\n")
    assert model.generate("hi", chat=True, chat_template_kwargs={"enable_thinking": True}, max_tokens=2,
                          temperature=0) is not None
    prefilled = {}
    for flag in ("--think", "--no-think"):  # the CLI's summary counts the prompt's tokens
        assert cli_main(["generate", "hi", "-m", str(path), "--device", "cpu", "--chat", flag, "-n", "2",
                         "--temp", "0"]) == 0
        prefilled[flag] = int(re.search(r"prefill (\d+) tok", capsys.readouterr().err).group(1))
    assert prefilled["--no-think"] - prefilled["--think"] == len(model.chat_ids("hi")) - len(
        model.chat_ids("hi", {"enable_thinking": True})) > 0


def test_cli_chat_keeps_the_conversation_and_reuses_its_cache(tiny_model):
    """`cupyllm chat`: a reply per input line, the conversation rendered with the chat template each turn, and
    every turn after the first prefilling only what the conversation added (the rest, the first prompt and as much
    of the reply as the template renders back to the same tokens, comes from the cache)."""
    path, _, _ = tiny_model("gemma3")
    out = subprocess.run([sys.executable, "-m", "cupyllm.cli", "chat", "-m", str(path), "-n", "4", "--temp", "0",
                          "--device", "cpu", "-c", "256", "--system", "be brief"],
                         input="the sea\n\nand the sky\n/exit\nnot read\n", capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    stats = [line for line in out.stderr.splitlines() if "prefill" in line and "decode" in line]
    assert len(stats) == 2, out.stderr  # the blank line is skipped, /exit ends it
    assert "cached)" not in stats[0] and "cached)" in stats[1]
    first_prompt = int(stats[0].split("prefill ")[1].split(" tok")[0])
    reused = int(stats[1].split("(+")[1].split(" cached)")[0])
    assert reused >= first_prompt  # the second turn's prompt begins with the whole first one (and its reply)
