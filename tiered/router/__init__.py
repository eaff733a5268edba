"""The router: a v2 server in front of the tier agents.

`table` (the routing table document), `policies` (pure routing choices),
`observations` (what the router measures of each agent) and `server` (the
gRPC adapter). The router talks to agents over gRPC only and never imports
agent or controller code.
"""
