"""Load generation and latency statistics for Hedgerow's benchmarks.

``bench.loadgen`` drives any OpenAI-compatible URL open-loop (Poisson
arrivals, latency from the intended send time) or closed-loop (fixed
concurrency); ``bench.records`` holds what was measured per request and
summarizes it; ``bench.stats`` computes the percentiles.
"""
