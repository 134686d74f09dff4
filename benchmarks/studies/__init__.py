"""Quality studies: how well the default scores find what a row was trained on (RANKING.md)."""
