"""Fakes that honour the real contracts: an in-process environment server, a scripted policy, a tokenizer.

They ship with the package because tests, benchmarks and the local rehearsal all use them.
"""
