"""Trace-driven simulation of the broker and of the policies it replaces (issue #5).

The engine (:mod:`.engine`) drives the real scheduling pass — or a baseline
behind the same interface (:mod:`.policies`) — over a workload
(:mod:`.workloads`) with a simulated clock, and measures what design.md §1 promises
(:mod:`.metrics`); :mod:`.report` writes the table and plots.
"""
