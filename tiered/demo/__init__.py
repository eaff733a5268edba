"""`tiered demo`: tiered shown end to end on this machine.

`rollouts` (`make demo`) runs the local system, sends traffic and rolls two
versions out, one promoted and one rolled back; `report` renders what the
controller recorded as an HTML page and its JSON twin; `tour`
(`tiered demo --protocol`) walks one agent through the v2 protocol with
tritonclient. Demonstrations only: of tiered, only the CLI imports this package.
"""
