"""The end-to-end tests use the same process launcher as the benchmarks."""

from bench.stack import Proc, Stack, free_port, free_port_run, scrape_metrics, wait_for

__all__ = ["Proc", "Stack", "free_port", "free_port_run", "scrape_metrics", "wait_for"]
