"""tiered: edge-to-cloud tiered deployment of ML inference.

Agents serve a model over the Open Inference Protocol (KServe v2 / Triton) on
each tier, a router picks the tier per request, and a controller rolls new
versions out tier by tier.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
