"""The raw HTTP/2 attack client lives with the benchmarks (``bench attacks``)."""

from bench.h2raw import RawH2, ServerSaid

__all__ = ["RawH2", "ServerSaid"]
