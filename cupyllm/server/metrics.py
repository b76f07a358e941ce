"""/metrics: the engine's counters in Prometheus' text format, under llama.cpp's metric names (llama-server's
`llamacpp:` prefix becomes `cupyllm:`), so dashboards made for llama-server read them."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "cupyllm:"


class _EngineCollector:
    def __init__(self, engine, model):
        self.engine, self.model = engine, model

    def collect(self):
        engine = self.engine
        c = engine.counters

        def counter(name, doc, value):
            family = CounterMetricFamily(PREFIX + name, doc)
            family.add_metric([], value)
            return family

        def gauge(name, doc, value):
            return GaugeMetricFamily(PREFIX + name, doc, value=value)

        yield counter("prompt_tokens", "Number of prompt tokens processed (not counting those a slot's cache held).",
                      c.prompt_tokens)
        yield counter("prompt_seconds", "Prompt process time.", c.prompt_seconds)
        yield counter("tokens_predicted", "Number of generation tokens processed.", c.tokens_predicted)
        yield counter("tokens_predicted_seconds", "Predict process time.", c.predicted_seconds)
        yield counter("n_decode", "Number of batched decode forwards.", c.decode_steps)
        yield counter("prompts_prefilled_together", "Prompt chunks prefilled in one forward with other prompts.",
                      c.prompts_together)
        yield counter("prompt_tokens_cached", "Prompt tokens a slot's cache held (not prefilled again).",
                      c.cached_tokens)
        yield counter("requests", "Requests accepted.", c.requests)
        yield counter("requests_rejected", "Requests refused with 503 (queue full).", c.requests_rejected)
        yield counter("requests_cancelled", "Requests stopped early (the client went away, or shutdown).",
                      c.requests_cancelled)
        yield gauge("n_busy_slots_per_decode", "Average number of busy slots per batched decode forward.",
                    c.busy_slots_in_decode / c.decode_steps if c.decode_steps else 0.0)
        yield gauge("prompt_tokens_seconds", "Average prompt throughput in tokens/s.",
                    c.prompt_tokens / c.prompt_seconds if c.prompt_seconds else 0.0)
        yield gauge("predicted_tokens_seconds", "Average generation throughput in tokens/s.",
                    c.tokens_predicted / c.predicted_seconds if c.predicted_seconds else 0.0)
        cached = sum(int(slot.cache.n_past) for slot in engine.slots)
        capacity = sum(int(slot.cache.spec.ctx) for slot in engine.slots)
        yield gauge("kv_cache_tokens", "KV cache tokens held by all slots.", cached)
        yield gauge("kv_cache_usage_ratio", "KV cache usage: tokens held / slots x n_ctx.",
                    cached / capacity if capacity else 0.0)
        yield gauge("requests_processing", "Number of requests processing.", engine.processing)
        yield gauge("requests_deferred", "Number of requests deferred (waiting for a slot).", engine.deferred)
        if self.model.spec is not None:
            yield counter("draft_tokens", "Draft tokens the target model checked.", c.drafted)
            yield counter("draft_tokens_accepted", "Draft tokens kept.", c.draft_accepted)


def metrics_text(engine, model) -> str:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_EngineCollector(engine, model))
    return generate_latest(registry).decode()
