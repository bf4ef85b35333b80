"""Fuzz tests: fixed budgets, derandomized, so that a run takes the same time and finds the same things."""
