"""Routing diagnostics for every router: per-expert load balance, routing fluctuation on a
fixed probe set, Symphony expert graphs; PNG pictures.

Pure functions (``load_summary``, ``fluctuation_rates``) and one object for the trainer
(:class:`RoutingDiagnostics`). Plotting (matplotlib) is imported only when PNGs are written.
"""
from .fluctuation import fluctuation_counts, fluctuation_rates, probe_assignments, ranked_experts
from .load import load_summary
from .collector import RoutingDiagnostics
from .summary import format_routing_summary, routing_summary

__all__ = ["RoutingDiagnostics", "load_summary", "fluctuation_rates", "fluctuation_counts", "probe_assignments",
           "ranked_experts", "routing_summary", "format_routing_summary"]
