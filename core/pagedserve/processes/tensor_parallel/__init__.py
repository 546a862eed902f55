"""Tensor parallelism as processes: the ranks of a tensor-parallel engine as worker processes (`mp`)
or Ray actors (`ray`). The floor below the engine core, which drives them each step: nothing here
imports the engine or the rest of `processes`."""
