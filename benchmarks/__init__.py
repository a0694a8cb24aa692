"""Benchmarks: plain decoding vs transformers, and the speculative decoding harness."""
