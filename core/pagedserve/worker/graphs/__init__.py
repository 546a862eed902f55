"""CUDA graphs of the forward: piecewise, full decode and full mixed-step graphs, the plan of which
ones an engine captures, and the one decider of the path a step takes."""
