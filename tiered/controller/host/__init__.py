"""The host backend: the local system's models reconciled against agents run
as processes on this machine (`backend`), its controller (`controller`), its
background builds (`builds`) and the state directory they share (`state`).
The local system itself (`tiered up`'s supervisor) is `tiered.local`."""
