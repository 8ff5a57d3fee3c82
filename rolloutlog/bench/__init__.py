"""Benchmarks behind ``rolloutlog bench``: each measures its baselines in the same run."""
