"""The compiled forward: inductor on a GPU (`gpu_compile`) and on a CPU (`cpu_compile`), and
compiled graphs saved whole on disk (`saved_compiles`)."""
