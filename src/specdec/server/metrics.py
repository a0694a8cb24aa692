"""``/metrics``: Prometheus text for one server, in a registry of its own (no global state).

Two sources: what the server times itself (TTFT, time per output token, request latency,
finish reasons, rejections, as histograms and counters) and what the generator counts (drafted
and accepted tokens, per-position acceptance, the k histogram, queue depth, KV pages, the
prefix cache), read at scrape time by a collector so the two never drift apart.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

__all__ = ["ServerMetrics"]

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80)
_TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)
_LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)


class ServerMetrics:
    """The metrics of one server over ``generator``.

    Example:
        >>> m = ServerMetrics(gen, model="qwen")
        >>> m.ttft.observe(0.2); m.render()   # bytes of Prometheus text
    """

    def __init__(self, generator, *, model: str) -> None:
        self.registry = CollectorRegistry()
        labels = ("model",)
        self._model = model
        self.ttft = Histogram("specdec_time_to_first_token_seconds", "Time to first token",
                              labels, buckets=_TTFT_BUCKETS, registry=self.registry).labels(model)  # fmt: skip
        self.tpot = Histogram("specdec_time_per_output_token_seconds", "Mean time per output token "
                              "after the first, per request", labels, buckets=_TPOT_BUCKETS,
                              registry=self.registry).labels(model)  # fmt: skip
        self.latency = Histogram("specdec_e2e_request_latency_seconds", "Request latency", labels,
                                 buckets=_LATENCY_BUCKETS, registry=self.registry).labels(model)  # fmt: skip
        self.finished = Counter("specdec_requests", "Requests ended, by finish reason",
                                ("model", "finish_reason"), registry=self.registry)  # fmt: skip
        self.rejected = Counter("specdec_requests_rejected", "Requests refused: invalid (400), "
                                "server full (429), draining (503)", ("model", "status"),
                                registry=self.registry)  # fmt: skip
        self.prompt_tokens = Counter("specdec_prompt_tokens", "Prompt tokens of admitted requests",
                                     labels, registry=self.registry).labels(model)  # fmt: skip
        self.registry.register(_GeneratorCollector(generator, model))

    def request_ended(self, finish_reason: str) -> None:
        self.finished.labels(self._model, finish_reason).inc()

    def request_rejected(self, status: int) -> None:
        self.rejected.labels(self._model, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _GeneratorCollector:
    """The generator's own counters, read at scrape time."""

    def __init__(self, generator, model: str) -> None:
        self._gen = generator
        self._model = model

    def describe(self):
        return []  # collected live; nothing to check at registration

    def collect(self):
        m = self._gen.metrics
        kv = self._gen.kv_stats()
        queue = self._gen.queue_stats()
        model = [self._model]

        def counter(name, doc, value):
            c = CounterMetricFamily(name, doc, labels=["model"])
            c.add_metric(model, value)
            return c

        def gauge(name, doc, value):
            g = GaugeMetricFamily(name, doc, labels=["model"])
            g.add_metric(model, value)
            return g

        yield counter("specdec_generation_tokens", "Tokens generated", m.num_generated_tokens)
        yield counter("specdec_target_passes", "Target forward passes over requests", m.num_target_forwards)
        yield counter("specdec_spec_decode_num_draft_tokens", "Draft tokens proposed and verified", m.num_drafted)
        yield counter("specdec_spec_decode_num_accepted_tokens", "Draft tokens accepted", m.num_accepted)
        yield counter("specdec_spec_decode_num_verify_steps", "Verification steps of requests", m.num_verify_steps)
        yield gauge("specdec_spec_decode_acceptance_rate", "Accepted / drafted tokens", m.acceptance_rate)
        yield gauge("specdec_spec_decode_mean_accepted_length",
                    "Tokens emitted per verification step (accepted drafts + 1)", m.mean_accepted_length)  # fmt: skip
        drafted = CounterMetricFamily("specdec_spec_decode_num_drafts_per_position",
                                      "Drafts at each position", labels=["model", "position"])  # fmt: skip
        accepted = CounterMetricFamily("specdec_spec_decode_num_accepted_tokens_per_position",
                                       "Accepted drafts at each position", labels=["model", "position"])  # fmt: skip
        rate = GaugeMetricFamily("specdec_spec_decode_acceptance_rate_per_position",
                                 "Acceptance at each draft position", labels=["model", "position"])  # fmt: skip
        for j, (d, a) in enumerate(zip(m.drafted_per_position, m.accepted_per_position)):
            drafted.add_metric([self._model, str(j)], d)
            accepted.add_metric([self._model, str(j)], a)
            rate.add_metric([self._model, str(j)], a / d if d else 0.0)
        yield drafted
        yield accepted
        yield rate
        ks = CounterMetricFamily("specdec_spec_decode_k", "Decode steps by the k the policy chose",
                                 labels=["model", "k"])  # fmt: skip
        for k, n in sorted(m.k_histogram.items()):
            ks.add_metric([self._model, str(k)], n)
        yield ks
        yield gauge("specdec_num_requests_running", "Requests in the running batch", queue["num_running"])
        yield gauge("specdec_num_requests_waiting", "Requests queued, not yet admitted", queue["num_waiting"])
        yield counter("specdec_num_preemptions", "Requests preempted for pages", queue["num_preemptions"])
        yield gauge("specdec_kv_pages_used", "KV pages held by sequences", kv["num_used_pages"])
        yield gauge("specdec_kv_pages_total", "KV pages in the pool", kv["num_total_pages"])
        yield gauge("specdec_kv_cache_usage_perc", "Fraction of KV pages in use",
                    kv["num_used_pages"] / kv["num_total_pages"] if kv["num_total_pages"] else 0.0)  # fmt: skip
        if "prefix_cache_query_tokens" in kv:
            q, h = kv["prefix_cache_query_tokens"], kv["prefix_cache_hit_tokens"]
            yield counter("specdec_prefix_cache_queries", "Prompt tokens looked up in the prefix cache", q)
            yield counter("specdec_prefix_cache_hits", "Prompt tokens found in the prefix cache", h)
            yield gauge("specdec_prefix_cache_hit_rate", "Hit tokens / queried tokens", h / q if q else 0.0)
            yield gauge("specdec_prefix_cache_pages", "KV pages holding cached prefixes", kv["prefix_cache_pages"])
            yield counter("specdec_prefix_cache_evictions", "Cached pages evicted", kv["prefix_cache_evictions"])
