"""Staged canary rollouts: the `TieredModel` spec, the statistical analysis and
the rollout engine.

`spec` (the TieredModel document, its validation and its OpenAPI schema),
`analysis` (canary vs stable, per metric: Successful / Failed / Inconclusive /
Error, or NotJudged when only shown, with the numbers used) and `engine`
(decide, pause, resume, promote, abort: status + measurements + now ->
Decision).

A pure judge: nothing here does I/O, reads the clock or draws random numbers,
and nothing here imports grpc, the agent, the router or the controller. The
controller's backends are thin adapters that feed it measurements and apply
its decisions.
"""
