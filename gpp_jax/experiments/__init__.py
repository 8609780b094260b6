"""Experiment scripts (reproductions of the GraphPipe paper comparisons)."""
