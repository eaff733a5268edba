"""The controller: reconcile TieredModels onto a backend (local processes or Kubernetes)."""
