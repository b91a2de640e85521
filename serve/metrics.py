"""Prometheus metrics: every series under a `clover:` name, and those vLLM has also under vLLM's own `vllm:` name
with its `model_name` label, so dashboards, alerts and autoscalers keyed on vLLM's series read this server too.

Mean acceptance length = 1 + accepted tokens / drafts (as in vLLM's spec-decode metrics). Every server has its
own registry, so several apps can live in one process (tests). The request timings follow vLLM's definitions:
queue (submitted to scheduled), prefill (scheduled to the first token), decode (first token to the last),
inference (scheduled to the last), end to end (submitted to the last).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import Metric

from clover.runtime.results import GenerationResult

PREFIX = "clover:"
VLLM_PREFIX = "vllm:"
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0)
REQUEST_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
# The series vLLM serves under the same name (vLLM's prefix): the rest are clover-deploy's own
VLLM_SERIES = {
    "prefix_cache_queries",
    "prefix_cache_hits",
    "num_requests_running",
    "num_requests_waiting",
    "kv_cache_usage_perc",
    "prompt_tokens",
    "generation_tokens",
    "request_success",
    "request_prompt_tokens",
    "request_generation_tokens",
    "request_params_n",
    "request_params_max_tokens",
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "e2e_request_latency_seconds",
    "request_queue_time_seconds",
    "request_inference_time_seconds",
    "request_prefill_time_seconds",
    "request_decode_time_seconds",
    "spec_decode_num_drafts",
    "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens",
    "spec_decode_num_accepted_tokens_per_pos",
}


class Metrics:
    """labels: added to every series (a Ray Serve replica's `replica`); `registry` is what /metrics exposes."""

    def __init__(self, engine, labels: Mapping[str, str] | None = None, model: str = "") -> None:
        """model: the served model's name, vLLM's `model_name` label on the vllm: series."""
        r = CollectorRegistry()
        self.caching = getattr(engine, "prefix_cache", None) is not None
        self.registry = WithVllmNames(ConstantLabels(r, labels) if labels else r, model)
        # Registered in this order, which is the order /metrics lists them in
        self._spec_decode_counters(r)
        self._request_counters(r)
        self._latency_histograms(r)
        self._length_histograms(r)
        self._engine_gauges(r, engine)

    def _spec_decode_counters(self, r: CollectorRegistry) -> None:
        """The drafting counters: drafts, drafted, accepted and pruned tokens, acceptances by position."""
        p = PREFIX
        self.drafts = Counter(p + "spec_decode_num_drafts", "Verify steps that checked drafted tokens", registry=r)
        self.draft_tokens = Counter(p + "spec_decode_num_draft_tokens", "Drafted tokens verified", registry=r)
        self.accepted_tokens = Counter(p + "spec_decode_num_accepted_tokens", "Drafted tokens accepted", registry=r)
        self.pruned_tokens = Counter(
            p + "spec_decode_num_pruned_tokens",
            "Drafted tokens a request's grammar forbade, left out of the verify (not in num_draft_tokens)",
            registry=r,
        )
        self.source_drafted = Counter(
            p + "spec_decode_source_draft_tokens",
            "Drafted tokens verified, by source (heads; prompt lookup's sequence, store, served)",
            ["source"],
            registry=r,
        )
        self.source_accepted = Counter(
            p + "spec_decode_source_accepted_tokens", "Drafted tokens accepted, by source", ["source"], registry=r
        )
        self.accepted_per_pos = Counter(
            p + "spec_decode_num_accepted_tokens_per_pos",
            "Drafted tokens accepted, by position in the accepted path",
            ["position"],
            registry=r,
        )

    def _request_counters(self, r: CollectorRegistry) -> None:
        """The finished requests' counters: their tokens, the prefix cache's queried and hit tokens, finish reasons and
        output-shaping options."""
        p = PREFIX
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Generated tokens of finished requests", registry=r)
        self.requests = Counter(
            p + "request_success",
            "Finished requests, by finish reason (abort: the client went away)",
            ["finished_reason"],
            registry=r,
        )
        self.cache_queries = Counter(
            p + "prefix_cache_queries", "Prompt tokens of finished requests looked up in the prefix cache", registry=r
        )
        self.cache_hits = Counter(
            p + "prefix_cache_hits", "Of them, the tokens whose caches came from the prefix cache", registry=r
        )
        self.options = Counter(
            p + "request_options",
            "Requests that set an output-shaping option (logprobs, a penalty, logit_bias, min_tokens, stop_token_ids, "
            "structured_output), by option",
            ["option"],
            registry=r,
        )

    def _latency_histograms(self, r: CollectorRegistry) -> None:
        """The timing histograms: per token (first token, inter-token) and per request (vLLM's phases)."""
        p = PREFIX
        self.ttft = Histogram(
            p + "time_to_first_token_seconds",
            "Time to first token (queueing and prefill)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            p + "inter_token_latency_seconds",
            "Time between a request's tokens (step time per token)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e, self.queue, self.inference, self.prefill, self.decode = (
            Histogram(p + name, what, buckets=REQUEST_BUCKETS, registry=r)
            for name, what in (
                ("e2e_request_latency_seconds", "Seconds from a request's arrival to its last token"),
                ("request_queue_time_seconds", "Seconds a request waited for a slot in the batch"),
                ("request_inference_time_seconds", "Seconds from joining the batch to the last token"),
                ("request_prefill_time_seconds", "Seconds from joining the batch to the first token"),
                ("request_decode_time_seconds", "Seconds from the first token to the last"),
            )
        )

    def _length_histograms(self, r: CollectorRegistry) -> None:
        """The per-request size histograms: prompt and generated tokens, the n and max_tokens asked for."""
        p = PREFIX
        self.prompt_lengths = Histogram(
            p + "request_prompt_tokens", "Prompt tokens per request", buckets=TOKEN_BUCKETS, registry=r
        )
        self.generation_lengths = Histogram(
            p + "request_generation_tokens", "Generated tokens per request", buckets=TOKEN_BUCKETS, registry=r
        )
        self.params_n = Histogram(
            p + "request_params_n", "The n of each request", buckets=(1, 2, 5, 10, 20), registry=r
        )
        self.params_max_tokens = Histogram(
            p + "request_params_max_tokens", "The max_tokens of each request", buckets=TOKEN_BUCKETS, registry=r
        )

    @staticmethod
    def _engine_gauges(r: CollectorRegistry, engine) -> None:
        """The engine's live state, read at each scrape: KV cache use, running and waiting requests, batch size."""
        p = PREFIX
        sched = engine.scheduler
        slots = engine.max_batch * engine.runner.info.max_context
        Gauge(
            p + "kv_cache_usage_perc",
            "Fraction of the KV cache the running sequences hold (their tokens over max_batch x the context)",
            registry=r,
        ).set_function(lambda: sum(len(q.prompt) + q.tracker.num_tokens for q in list(sched.running)) / slots)
        Gauge(p + "num_requests_running", "Requests in the batch", registry=r).set_function(lambda: len(sched.running))
        Gauge(p + "num_requests_waiting", "Requests queued for a slot", registry=r).set_function(
            lambda: len(sched.waiting)
        )
        # Not num_requests_running: a request cancelled or finished since the last step still counts there.
        Gauge(p + "batch_size", "Sequences in the engine's last forward (0 while idle)", registry=r).set_function(
            lambda: engine.step_sequences
        )
        Gauge(p + "max_batch", "Sequences a step can decode at once", registry=r).set(engine.max_batch)

    def finished(self, result: GenerationResult, reason: str) -> None:
        """Account one finished request."""
        self.requests.labels(reason).inc()
        self.prompt_tokens.inc(result.prompt_tokens)
        self.generation_tokens.inc(result.new_tokens)
        if self.caching:
            self.cache_queries.inc(result.prompt_tokens)
            self.cache_hits.inc(result.cached_tokens)
        self.draft_tokens.inc(result.drafted_tokens)
        self.accepted_tokens.inc(result.accepted_tokens)
        self.pruned_tokens.inc(result.pruned_tokens)
        self.drafts.inc(result.draft_steps)
        for source, (drafted, accepted) in result.drafts_by_source.items():
            self.source_drafted.labels(source).inc(drafted)
            self.source_accepted.labels(source).inc(accepted)
        for emitted in result.accepted_per_step:
            for position in range(emitted - 1):  # the bonus token is not a draft
                self.accepted_per_pos.labels(str(position)).inc()
        if result.new_tokens:
            self.ttft.observe(result.time_to_first_token)
            self.prefill.observe(max(result.time_to_first_token - result.queue_seconds, 0.0))
            self.decode.observe(max(result.seconds - result.time_to_first_token, 0.0))
        self.e2e.observe(result.seconds)
        self.queue.observe(result.queue_seconds)
        self.inference.observe(max(result.seconds - result.queue_seconds, 0.0))
        self.prompt_lengths.observe(result.prompt_tokens)
        self.generation_lengths.observe(result.new_tokens)
        left = max(result.new_tokens - 1, 0)  # tokens after the first (the last step's may be cut by max_tokens)
        for emitted, seconds in zip(result.accepted_per_step, result.step_seconds):
            for _ in range(min(emitted, left)):
                self.itl.observe(seconds / emitted)
            left -= min(emitted, left)


class WithVllmNames:
    """A registry's series, and each one vLLM has (VLLM_SERIES) again under vLLM's name and `model_name` label."""

    def __init__(self, registry, model: str) -> None:
        self.inner, self.model = registry, model

    def collect(self) -> Iterator[Metric]:
        for family in self.inner.collect():
            yield family
            name = family.name.removeprefix(PREFIX)
            if name in VLLM_SERIES:
                twin = Metric(VLLM_PREFIX + name, family.documentation, family.type, family.unit)
                twin.samples = [
                    s._replace(
                        name=VLLM_PREFIX + s.name.removeprefix(PREFIX), labels={"model_name": self.model, **s.labels}
                    )
                    for s in family.samples
                ]
                yield twin


class ConstantLabels:
    """A registry's series with the same labels added to each (prometheus_client has no constant labels)."""

    def __init__(self, registry: CollectorRegistry, labels: Mapping[str, str]) -> None:
        self.inner, self.labels = registry, dict(labels)

    def collect(self) -> Iterator[Metric]:
        for family in self.inner.collect():
            family.samples = [s._replace(labels={**self.labels, **s.labels}) for s in family.samples]
            yield family
