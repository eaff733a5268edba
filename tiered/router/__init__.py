"""The router: a v2 server in front of the tier agents.

`policies` (pure routing choices), `hints` (what a request asks for),
`observations` (what the router measures of each agent), `forward` (the calls
to agents: failover, cascade, shadows), `counters` (Prometheus and the shadow
agreement tally), `statistics` (Triton-shaped statistics), `dataplane` (one
request, end to end), `servicer` (the gRPC services) and `server` (the
process). The routing table's schema is `tiered.protocol.routing`. The router
talks to agents over gRPC only and never imports agent or controller code.
"""
