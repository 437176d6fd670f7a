"""Service processes for tests (see svc_common.processes)."""

from svc_common.processes import REPO, Cluster, ServiceProcess

__all__ = ["REPO", "Cluster", "ServiceProcess"]
