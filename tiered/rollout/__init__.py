"""Staged canary rollouts: the `TieredModel` spec, the statistical analysis and
the rollout engine.

`spec` and `status` (the TieredModel document and its status, as dataclasses),
`schema` (their fields' constraints), `wire` (how they are written, in each API
version), `openapi` (the CRD's schema, made from them), `analysis` (canary vs
stable, per metric: Successful / Failed / Inconclusive / Error, or NotJudged
when only shown, with the numbers used), `engine` (decide, pause, resume,
promote, abort: status + measurements + now -> Decision), `snapshot` (where a
rollout stands at a decision and the figures it used, as the history keeps
them) and `progress` (a snapshot's terminal line).

A pure judge: nothing here does I/O, reads the clock or draws random numbers,
and nothing here imports grpc, the agent, the router or the controller. The
controller's backends are thin adapters that feed it measurements and apply
its decisions.
"""
