"""Remediation: from the health machine's decisions to Kubernetes state, safely.

- ``limits``: safety limits and the breaker (pure, part of the detection pipeline, so replay and
  every replica decide ``held`` the same way);
- ``model``: ``NodeIntent`` (what the pipeline wants a node to look like) and ``HealthSnapshot``
  (the annotation that lets a restarted aggregator rebuild its state from the cluster);
- ``preflight``: when a new node has passed;
- ``planner``: what one node should look like, as a pure function (taints, annotations, condition,
  events, waits);
- ``workqueue``: the token bucket, the work queue and the per-node retry backoff;
- ``actuator``: the leader's reconciler that applies the planner's plans to nodes.
"""
