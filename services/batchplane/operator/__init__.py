"""The Kubernetes operator: partitioning sources into loader groups and scaling them from the mixture."""
