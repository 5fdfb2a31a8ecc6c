"""Injected infrastructure faults: what a fault is (:mod:`.kinds`), the proxy that puts them in front of any
environment server (:mod:`.proxy`), and the rules a local training run strikes by (:mod:`.injected`)."""
