"""Evaluation suites: lost-in-the-middle tasks, metrics, reports, and the methods registry."""
