"""Round-trip latency of one operator as a client sees it: the
:class:`Client` method ``benchmark`` (the daemon has no Benchmark RPC)."""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Dict, List

import numpy as np

from . import errors
from .ops import OPS


@dataclasses.dataclass
class BenchmarkResult:
    """Round-trip latency of one operator as this client sees it."""

    op: str
    tokens: int
    dtype: str
    iterations: int
    latencies_ms: List[float]
    bytes_sent: int
    bytes_received: int

    @property
    def median_ms(self) -> float:
        return statistics.median(self.latencies_ms)

    @property
    def p90_ms(self) -> float:
        ordered = sorted(self.latencies_ms)
        return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]

    @property
    def min_ms(self) -> float:
        return min(self.latencies_ms)


class BenchmarkCalls:
    """Mixed into :class:`mhc_client.Client` (which provides ``_call``,
    ``get_layer`` and ``build_request``)."""

    def benchmark(self, layer: str, op: str = "pre", tokens: int = 128,
                  dtype: str = "bf16", iterations: int = 20, warmup: int = 3,
                  seed: int = 0) -> BenchmarkResult:
        """Times `op` (pre, post, pre_backward, post_backward) round trips.

        The daemon has no Benchmark RPC; this measures what a client sees
        (serialisation, transport and kernel) on random data shaped for the
        layer. Backward runs skip parameter gradients, so the layer's
        accumulators are left untouched.
        """
        info = self.get_layer(layer)
        n, c = info.spec.n, info.spec.hidden
        rng = np.random.default_rng(seed)
        x_shape = (tokens, n, c) if info.spec.layout != "stream_minor" else (tokens, c, n)
        x = rng.standard_normal(x_shape).astype(np.float32)
        f = rng.standard_normal((tokens, c)).astype(np.float32)
        h_post = rng.random((tokens, n)).astype(np.float32)
        h_res = np.full((tokens, n, n), 1.0 / n, np.float32)
        args: Dict[str, Any] = {
            "pre": dict(x=x),
            "post": dict(f=f, x=x, h_post=h_post, h_res=h_res),
            "pre_backward": dict(x=x, dy=f, dh_post=h_post, dh_res=h_res,
                                 skip_parameter_gradients=True),
            "post_backward": dict(dx_next=x, f=f, x=x, h_post=h_post,
                                  h_res=h_res, skip_parameter_gradients=True),
        }.get(op)  # type: ignore[assignment]
        if args is None:
            raise errors.InvalidArgument(
                "benchmark: op must be pre, post, pre_backward or post_backward")
        request = self.build_request(op, layer, dtype, None, **args)
        spec = OPS[op]
        latencies: List[float] = []
        received = 0
        for i in range(warmup + iterations):
            start = time.perf_counter()
            response = self._call(spec.rpc, request)
            elapsed = (time.perf_counter() - start) * 1e3
            if i >= warmup:
                latencies.append(elapsed)
                received = response.ByteSize()
        return BenchmarkResult(op=op, tokens=tokens, dtype=dtype,
                               iterations=iterations, latencies_ms=latencies,
                               bytes_sent=request.ByteSize(),
                               bytes_received=received)
