"""gpuwarden aggregator: ingests the fleet's reports, decides which nodes and links are unhealthy."""
