"""Prometheus text exposition of the server's counters, written by hand (no extra dependency)."""

from __future__ import annotations

import collections
import threading
import time

# Time-to-first-token histogram bucket bounds, seconds.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# Generated tokens/s is averaged over this trailing window, seconds.
RATE_WINDOW_S = 10.0


class Metrics:
    """Counters updated by the routes; `render` writes them in Prometheus text format 0.0.4."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: collections.Counter[tuple[str, int]] = collections.Counter()
        self._prompt_tokens = 0
        self._generated_tokens = 0
        self._ttft_counts = [0] * len(TTFT_BUCKETS)
        self._ttft_sum = 0.0
        self._ttft_count = 0
        self._recent: collections.deque[tuple[float, int]] = collections.deque()

    def request_done(self, route: str, status: int) -> None:
        """Counts one answered request by route and HTTP status."""
        with self._lock:
            self._requests[(route, status)] += 1

    def prompt(self, tokens: int) -> None:
        """Counts prompt tokens of an admitted request."""
        with self._lock:
            self._prompt_tokens += tokens

    def first_token(self, seconds: float) -> None:
        """Records one time-to-first-token (request received to first token sampled)."""
        with self._lock:
            self._ttft_sum += seconds
            self._ttft_count += 1
            for i, bound in enumerate(TTFT_BUCKETS):
                if seconds <= bound:
                    self._ttft_counts[i] += 1

    def generated(self, tokens: int) -> None:
        """Counts generated tokens (for the total and the trailing tokens/s)."""
        now = time.monotonic()
        with self._lock:
            self._generated_tokens += tokens
            self._recent.append((now, tokens))
            self._trim(now)

    def tokens_per_second(self) -> float:
        """Generated tokens per second over the trailing window."""
        now = time.monotonic()
        with self._lock:
            self._trim(now)
            return sum(n for _, n in self._recent) / RATE_WINDOW_S

    def _trim(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
            self._recent.popleft()

    def render(
        self, waiting: int, running: int, slots: int, decode_steps: int, decode_rows: int
    ) -> str:
        """The /metrics body; the arguments are read from the scheduler."""
        rate = self.tokens_per_second()
        with self._lock:
            lines = [
                "# HELP hetmoe_queue_depth Requests waiting for a KV slot.",
                "# TYPE hetmoe_queue_depth gauge",
                f"hetmoe_queue_depth {waiting}",
                "# HELP hetmoe_running_requests Requests holding a KV slot.",
                "# TYPE hetmoe_running_requests gauge",
                f"hetmoe_running_requests {running}",
                "# HELP hetmoe_kv_slots KV-cache slots (sequences decoded together at most).",
                "# TYPE hetmoe_kv_slots gauge",
                f"hetmoe_kv_slots {slots}",
                "# HELP hetmoe_decode_steps_total Batched decode steps.",
                "# TYPE hetmoe_decode_steps_total counter",
                f"hetmoe_decode_steps_total {decode_steps}",
                "# HELP hetmoe_decode_rows_total Sequences decoded, summed over steps.",
                "# TYPE hetmoe_decode_rows_total counter",
                f"hetmoe_decode_rows_total {decode_rows}",
                f"# HELP hetmoe_tokens_per_second Generated tokens/s, last {RATE_WINDOW_S:g} s.",
                "# TYPE hetmoe_tokens_per_second gauge",
                f"hetmoe_tokens_per_second {rate:.3f}",
                "# HELP hetmoe_generated_tokens_total Tokens generated.",
                "# TYPE hetmoe_generated_tokens_total counter",
                f"hetmoe_generated_tokens_total {self._generated_tokens}",
                "# HELP hetmoe_prompt_tokens_total Prompt tokens admitted.",
                "# TYPE hetmoe_prompt_tokens_total counter",
                f"hetmoe_prompt_tokens_total {self._prompt_tokens}",
                "# HELP hetmoe_time_to_first_token_seconds Request received to first token.",
                "# TYPE hetmoe_time_to_first_token_seconds histogram",
            ]
            for bound, count in zip(TTFT_BUCKETS, self._ttft_counts, strict=True):
                lines.append(f'hetmoe_time_to_first_token_seconds_bucket{{le="{bound:g}"}} {count}')
            lines += [
                f'hetmoe_time_to_first_token_seconds_bucket{{le="+Inf"}} {self._ttft_count}',
                f"hetmoe_time_to_first_token_seconds_sum {self._ttft_sum:.6f}",
                f"hetmoe_time_to_first_token_seconds_count {self._ttft_count}",
                "# HELP hetmoe_requests_total Answered requests by route and status.",
                "# TYPE hetmoe_requests_total counter",
            ]
            for (route, status), count in sorted(self._requests.items()):
                lines.append(
                    f'hetmoe_requests_total{{route="{route}",status="{status}"}} {count}'
                )
        return "\n".join(lines) + "\n"
