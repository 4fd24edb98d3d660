"""saguaro's Prometheus series, next to SGLang's own on ``/metrics`` (``--enable-metrics``).

They live in the scheduler process, where the worker runs, and reach the HTTP server's ``/metrics``
the way SGLang's scheduler metrics do (prometheus_client multiprocess mode, PROMETHEUS_MULTIPROC_DIR
set by SGLang before it spawns the scheduler).  Names follow SGLang's: the ``sglang:`` prefix, snake
case, counters ending in ``_total``, seconds for times, and SGLang's scheduler labels (model_name,
engine_type, tp_rank, pp_rank, moe_ep_rank).  SGLang's own ``sglang:spec_accept_length`` /
``sglang:spec_accept_rate`` keep working: the scheduler computes them from our accept lengths.

  sglang:saguaro_rounds_total                 decode rounds verified
  sglang:saguaro_rows_total                   request rows verified (a round has one per request)
  sglang:saguaro_cache_hits_total             rows whose speculation came from the speculation cache
  sglang:saguaro_cache_hit_rate               hits / rows since start (gauge)
  sglang:saguaro_backup_rows_total{kind}      missed rows answered by the backup: kind neural | fast
                                              (sync mode / SD: every row is drafted this way, neural)
  sglang:saguaro_fallback_rows_total          rows decoded target-only (no usable draft reply)
  sglang:saguaro_draft_wait_seconds           per round: time the worker waited for the draft's reply
  sglang:saguaro_verify_seconds               per round: the target's chain-verify forward
  sglang:saguaro_accept_seconds               per round: target probabilities + exact acceptance
  sglang:saguaro_cache_build_seconds          per draft cache build (glue + tree + store; cut builds too)
  sglang:saguaro_cache_builds_cut_total{depth} builds cut short by the next round, by depths finished
                                              (a reply reports its last build's cut: the usual one)
  sglang:saguaro_draft_errors_total           broken-link failures (dead draft, error or bad reply)
  sglang:saguaro_deadline_misses_total        replies that missed the round deadline (round ran target-only)
  sglang:saguaro_reconnects_total{resumed}    reconnects to the draft; resumed="true" kept its state
"""

from __future__ import annotations

import logging
from typing import Optional

logger = logging.getLogger(__name__)

# round-level times: 0.5 ms .. ~16 s, like SGLang's latency buckets on a log scale
_TIME_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)


def scheduler_labels(server_args) -> dict:
    """The labels SGLang's SchedulerMetricsCollector puts on its series (metrics_collector.py)."""
    try:
        from sglang.srt.disaggregation.utils import DisaggregationMode
        from sglang.srt.runtime_context import get_disagg, get_observability, get_parallel, get_serving

        par = get_parallel()
        labels = {"model_name": get_serving().served_model_name,
                  "engine_type": DisaggregationMode.to_engine_type(get_disagg().disaggregation_mode),
                  "tp_rank": par.tp_rank, "pp_rank": par.pp_rank, "moe_ep_rank": par.moe_ep_rank}
        if par.dp_rank is not None:
            labels["dp_rank"] = par.dp_rank
        labels.update(get_observability().extra_metric_labels or {})
        return labels
    except (ImportError, AttributeError, ValueError, RuntimeError):  # no runtime context (a worker built in a test)
        return {"model_name": getattr(server_args, "served_model_name", None) or getattr(server_args, "model_path", ""),
                "engine_type": "unified", "tp_rank": 0, "pp_rank": 0, "moe_ep_rank": 0}


_INSTANCE: Optional["SaguaroMetrics"] = None


def _exporting_rank(server_args) -> bool:
    try:
        from sglang.srt.runtime_context import get_parallel

        par = get_parallel()
        return (par.attn_tp_rank == 0 and getattr(par, "attn_cp_rank", 0) == 0) or \
            bool(getattr(server_args, "enable_metrics_for_all_schedulers", False))
    except (ImportError, AttributeError, ValueError, RuntimeError):  # no runtime context: a single rank
        return True


class SaguaroMetrics:
    """Counters, gauges and histograms, updated by the worker once per verified round."""

    def __init__(self, labels: dict):
        from prometheus_client import Counter, Gauge, Histogram

        self.labels = {k: str(v) for k, v in labels.items()}
        names = list(self.labels)

        def counter(name, doc, extra=()):
            return Counter(f"sglang:saguaro_{name}", doc, labelnames=names + list(extra))

        def hist(name, doc):
            return Histogram(f"sglang:saguaro_{name}", doc, labelnames=names, buckets=_TIME_BUCKETS)

        self._rounds = counter("rounds_total", "Decode rounds verified by saguaro.")
        self._rows = counter("rows_total", "Request rows verified by saguaro (one per request per round).")
        self._hits = counter("cache_hits_total", "Rows whose speculation came from the draft's speculation cache.")
        self._hit_rate = Gauge("sglang:saguaro_cache_hit_rate", "Speculation-cache hit rate (hits / rows) since "
                               "start.", labelnames=names, multiprocess_mode="mostrecent")
        self._backup = counter("backup_rows_total", "Missed rows answered by the draft's backup, by kind.", ["kind"])
        self._fallback = counter("fallback_rows_total", "Rows decoded target-only (no usable draft reply).")
        self._wait = hist("draft_wait_seconds", "Per round: time the worker waited for the draft's reply.")
        self._verify = hist("verify_seconds", "Per round: the target's chain-verify forward.")
        self._accept = hist("accept_seconds", "Per round: target probabilities and exact acceptance.")
        self._build = hist("cache_build_seconds", "Per draft cache build (glue forward, tree forwards, store).")
        self._cut = counter("cache_builds_cut_total", "Cache builds cut short by the next round, by depths "
                            "finished.", ["depth"])
        self._errors = counter("draft_errors_total", "Broken-link failures: dead draft, error or malformed reply.")
        self._misses = counter("deadline_misses_total", "Draft replies that missed the round deadline.")
        self._reconnects = counter("reconnects_total", "Reconnects to the draft process; resumed=true kept its "
                                   "state.", ["resumed"])
        self._last: dict[str, int] = {}
        # every series exists from the start (a dashboard sees 0, not "no data")
        for kind in ("neural", "fast"):
            self._backup.labels(**self.labels, kind=kind)
        for resumed in ("true", "false"):
            self._reconnects.labels(**self.labels, resumed=resumed)
        for c in (self._rounds, self._rows, self._hits, self._fallback, self._errors, self._misses):
            c.labels(**self.labels)

    @classmethod
    def maybe(cls, server_args) -> Optional["SaguaroMetrics"]:
        """The process's one instance (prometheus_client refuses a second registration of a name), on the
        ranks SGLang exports its scheduler metrics from (attention TP rank 0, or all with
        --enable-metrics-for-all-schedulers); None without --enable-metrics."""
        global _INSTANCE
        if not getattr(server_args, "enable_metrics", False) or not _exporting_rank(server_args):
            return None
        if _INSTANCE is None:
            try:
                _INSTANCE = cls(scheduler_labels(server_args))
            except Exception as exc:  # metrics must never stop serving
                logger.warning("saguaro metrics disabled: %s", exc)
                return None
        return _INSTANCE

    # ---- once per verified round, from the worker --------------------------------------------
    def observe(self, stats, wait_s: float, verify_s: float, accept_s: float) -> None:
        """stats: DraftLink's LinkStats, cumulative: every counter advances by what changed since the
        last call (faults and late replies between rounds included); the times are this round's."""
        lb = self.labels
        now = {"rounds": stats.rounds, "rows": stats.rows, "hits": stats.hits, "fallback": stats.fallback_rows,
               "errors": stats.errors, "misses": stats.deadline_misses, "resumes": stats.resumes,
               "resets": stats.resets, "fast": stats.fast_rows, "neural": stats.backup_rows - stats.fast_rows,
               "builds": stats.builds, "build_ms": stats.build_ms,
               **{f"cut{d}": n for d, n in stats.cuts.items()}}
        d = {k: v - self._last.get(k, 0) for k, v in now.items()}
        self._last = now
        for key, c in (("rounds", self._rounds), ("rows", self._rows), ("hits", self._hits),
                       ("fallback", self._fallback), ("errors", self._errors), ("misses", self._misses)):
            if d[key]:
                c.labels(**lb).inc(d[key])
        for key, label in (("resumes", "true"), ("resets", "false")):
            if d[key]:
                self._reconnects.labels(**lb, resumed=label).inc(d[key])
        for kind in ("fast", "neural"):
            if d[kind]:
                self._backup.labels(**lb, kind=kind).inc(d[kind])
        for key, n in d.items():
            if key.startswith("cut") and n:
                self._cut.labels(**lb, depth=key[3:]).inc(n)
        for _ in range(d["builds"]):  # one observation per build; several since the last round share their mean
            self._build.labels(**lb).observe(d["build_ms"] / 1e3 / d["builds"])
        self._hit_rate.labels(**lb).set(stats.hits / max(stats.rows, 1))
        self._wait.labels(**lb).observe(wait_s)
        self._verify.labels(**lb).observe(verify_s)
        self._accept.labels(**lb).observe(accept_s)
