"""Counterfactual validation of the scores: does removing rows move a query's loss as the scores say?

    subsets.py   the M random alpha-subsets of the training rows, and each subset's query losses on disk
    retrain.py   one plain Lightning fine-tune on a subset, then every query's summed loss under it
    lds.py       the Linear Datamodeling Score: per query, Spearman over subsets of summed scores vs -loss

The recipe that runs them is recipes/validate.py (`gradian validate`); docs/validate.md gives the
protocol and its caveats.
"""
