"""gpuwarden node agent: reads GPUs and NICs, sends one report per interval to the aggregator."""

__version__ = "0.1.0"
