"""Performance benchmarks: what indexing and querying cost (RESULTS.md)."""
