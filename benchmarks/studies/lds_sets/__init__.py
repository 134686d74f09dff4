"""LDS sets that disagree with each other (issue 29): see README.md; `python -m benchmarks.studies.lds_sets.run KIND`."""
