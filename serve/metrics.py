"""Prometheus metrics under the names vLLM dashboards read, with a `clover:` prefix instead of `vllm:`.

Mean acceptance length = 1 + accepted tokens / drafts (as in vLLM's spec-decode metrics). Every server has its
own registry, so several apps can live in one process (tests).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import Metric

from clover.runtime.results import GenerationResult

PREFIX = "clover:"
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0)


class Metrics:
    """labels: added to every series (a Ray Serve replica's `replica`); `registry` is what /metrics exposes."""

    def __init__(self, engine, labels: Mapping[str, str] | None = None) -> None:
        self.registry = r = CollectorRegistry()
        if labels:
            self.registry = ConstantLabels(r, labels)
        p = PREFIX
        self.drafts = Counter(p + "spec_decode_num_drafts", "Verify steps that checked drafted tokens", registry=r)
        self.draft_tokens = Counter(p + "spec_decode_num_draft_tokens", "Drafted tokens verified", registry=r)
        self.accepted_tokens = Counter(p + "spec_decode_num_accepted_tokens", "Drafted tokens accepted", registry=r)
        self.pruned_tokens = Counter(
            p + "spec_decode_num_pruned_tokens",
            "Drafted tokens a request's grammar forbade, left out of the verify (not in num_draft_tokens)",
            registry=r,
        )
        self.accepted_per_pos = Counter(
            p + "spec_decode_num_accepted_tokens_per_pos",
            "Drafted tokens accepted, by position in the accepted path",
            ["position"],
            registry=r,
        )
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Generated tokens of finished requests", registry=r)
        self.requests = Counter(
            p + "request_success",
            "Finished requests, by finish reason (abort: the client went away)",
            ["finished_reason"],
            registry=r,
        )
        self.options = Counter(
            p + "request_options",
            "Requests that set an output-shaping option (logprobs, a penalty, logit_bias, min_tokens, stop_token_ids, "
            "structured_output), by option",
            ["option"],
            registry=r,
        )
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
        sched = engine.scheduler
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
        self.draft_tokens.inc(result.drafted_tokens)
        self.accepted_tokens.inc(result.accepted_tokens)
        self.pruned_tokens.inc(result.pruned_tokens)
        self.drafts.inc(result.draft_steps)
        for emitted in result.accepted_per_step:
            for position in range(emitted - 1):  # the bonus token is not a draft
                self.accepted_per_pos.labels(str(position)).inc()
        if result.new_tokens:
            self.ttft.observe(result.time_to_first_token)
        left = max(result.new_tokens - 1, 0)  # tokens after the first (the last step's may be cut by max_tokens)
        for emitted, seconds in zip(result.accepted_per_step, result.step_seconds):
            for _ in range(min(emitted, left)):
                self.itl.observe(seconds / emitted)
            left -= min(emitted, left)


class ConstantLabels:
    """A registry's series with the same labels added to each (prometheus_client has no constant labels)."""

    def __init__(self, registry: CollectorRegistry, labels: Mapping[str, str]) -> None:
        self.inner, self.labels = registry, dict(labels)

    def collect(self) -> Iterator[Metric]:
        for family in self.inner.collect():
            family.samples = [s._replace(labels={**self.labels, **s.labels}) for s in family.samples]
            yield family
