"""Benchmarks that back the README's performance and quality claims; see benchmarks/RESULTS.md."""
