"""The local system: the whole of tiered on one machine, no cluster.

`supervisor` is `tiered up`: it starts an agent per tier, the router and the
controller as child processes, restarts them when they die and stops them in
order. `processes` starts and stops one `tiered agent` or `tiered router`
process (also for the demo, the benchmarks and the tests). The controller's
host backend (`tiered.controller.host`) owns the state directory's layout;
this package only starts processes around it and never reconciles anything
itself.
"""
