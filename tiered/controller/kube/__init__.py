"""The Kubernetes backend: TieredModel resources, workloads per tier and
version, the routing ConfigMap, leader election and the user's cluster verbs.

`controller` runs the process (Lease, watch, work queue); `backend` observes
and applies for the shared Reconciler; `render` is the pure form of every
object; `lease` and `queue` are the machinery; `verbs` are the CLI's.
"""
