"""Executors: the ranks of a tensor-parallel engine as worker processes (`mp`) or Ray actors (`ray`)."""
