"""The HTML report of a query run (`gradian report`): html.py renders it; recipes/report.py gathers its numbers."""
