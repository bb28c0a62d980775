"""The fleet's recent history: per node (for rules) and columnar per pool (for vectorized detectors)."""
